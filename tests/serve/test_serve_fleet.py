"""`portcullis serve --model A --model B:FLAGS` (issue 17 item 5): one engine per model on its own
private socket, all behind one gateway, supervised; SIGTERM leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from portcullis.supervisor import serve
from portcullis.supervisor.fleet import (
    ModelSpec,
    generated_policy_path,
    parse_model_spec,
    plan_engines,
    upstreams_text,
    write_generated_policy,
)

from .test_serve import REPO, _alive, _cmdline, _descendants, _free_port, _ready, _wait

FLAGS = ["--max-model-len", "256", "--kv-cache-memory", "16MiB"]


def test_model_specs_take_their_own_flags_and_names():
    assert parse_model_spec("demo") == ModelSpec(None, (), ("demo",))
    spec = parse_model_spec("/models/a:b:--max-model-len=4096 --served-model-name code")
    assert spec == ModelSpec("/models/a:b", ("--max-model-len=4096", "--served-model-name", "code"), ("code",))
    assert parse_model_spec("demo:--served-model-name=x,y").names == ("x,y",)  # one name, as the engine reads it
    with pytest.raises(ValueError, match="before the flags"):
        parse_model_spec(":--dtype=float32")


def test_the_generated_upstreams_are_a_valid_policy_beside_the_users(tmp_path):
    from portcullis.gateway.policy.loader import load_policy

    specs = [parse_model_spec("demo"), parse_model_spec("demo:--served-model-name=demo-b")]
    slots = plan_engines(specs, 2, ["--dtype", "float32"], tmp_path, tmp_path / "token", "python", {})
    assert [s.name for s in slots] == ["demo-1", "demo-2", "demo-b-1", "demo-b-2"]
    assert len({s.sock for s in slots}) == 4
    assert slots[0].child.argv[-2:] == ["--served-model-name", "demo"]  # the bundled model: no MODEL given
    assert slots[2].child.argv[-1] == "--served-model-name=demo-b"  # its own flags last: they win
    policy = tmp_path / "policy.yaml"
    policy.write_text(serve.starter_policy(policy, 8))
    generated = write_generated_policy(policy, upstreams_text(slots))
    assert generated == generated_policy_path(policy) and generated.parent == policy.parent
    loaded = load_policy(generated)
    assert [(u.name, u.models) for u in loaded.policy.upstreams] == [
        ("demo-1", ["demo"]), ("demo-2", ["demo"]), ("demo-b-1", ["demo-b"]), ("demo-b-2", ["demo-b"])]
    assert oct(generated.stat().st_mode & 0o777) == "0o600"


def test_one_model_flag_is_the_one_engine_serve(tmp_path):
    args, flags = serve.build_parser().parse_known_args(["--model", "demo:--dtype=float32", "--port", "1"])
    args.model = None
    assert serve._fleet_specs(args, flags) == ([], None) and args.model is None and flags == ["--dtype=float32"]
    args, flags = serve.build_parser().parse_known_args(["--model", "a", "--model", "b", "--served-model-name", "x"])
    args.model = None
    assert "name each in its own flags" in serve._fleet_specs(args, flags)[1]
    args, flags = serve.build_parser().parse_known_args(["--served-model-name", "x", "--replicas", "2"])
    args.model = None
    assert serve._fleet_specs(args, flags) == ([ModelSpec(None, (), ("x",))], None)


def test_two_engines_behind_one_gateway_and_no_orphan_after_sigterm(tmp_path):
    port, home = _free_port(), tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "PORTCULLIS_ENGINE_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.cli", "serve", "--model", "demo", "--model", "demo:--served-model-name=demo-b",
         "--port", str(port), "--home", str(home), *FLAGS],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        key, deadline = None, time.monotonic() + 240
        while key is None:
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not print a key"
            line = proc.stdout.readline().strip()
            key = line if line.startswith("ptc_") else None
        base = f"http://127.0.0.1:{port}"
        _wait(lambda: _ready(base), 120, "the gateway to be ready")
        auth = {"authorization": f"Bearer {key}"}
        _wait(lambda: len(httpx.get(f"{base}/v1/models", headers=auth).json()["data"]) == 2, 30, "both engines")
        for model in ("demo", "demo-b"):
            reply = httpx.post(f"{base}/v1/completions", headers=auth, timeout=60,
                               json={"model": model, "prompt": "def f(x):", "max_tokens": 3})
            assert reply.status_code == 200 and reply.json()["model"] == model
        def served_by() -> dict:  # the audit line is written just after the reply
            lines = [json.loads(x) for x in (home / "audit.log").read_text().splitlines() if x.startswith("{")]
            return {r.get("model"): r.get("upstream") for r in lines if r.get("path") == "/v1/completions"}

        _wait(lambda: len(served_by()) == 2, 10, "the audit lines")
        assert served_by() == {"demo": "demo-1", "demo-b": "demo-b-1"}
        assert "upstreams" not in yaml.safe_load((home / "policy.yaml").read_text())  # the user's file untouched
        generated = generated_policy_path(home / "policy.yaml")
        with open(home / "policy.yaml", "a") as policy:  # an edit reaches the gateway's copy
            policy.write("# edited while serving\n")
        _wait(lambda: "# edited while serving" in generated.read_text(), 10, "the generated policy to follow")
        assert "upstreams:" in generated.read_text()
        ours = _descendants(proc.pid)
        assert sum("-m portcullis.engine" in _cmdline(p) for p in ours) == 2 and any("gateway" in _cmdline(p) for p in ours)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        _wait(lambda: not any(_alive(p) for p in ours), 20, "every child to exit")
        assert not generated_policy_path(home / "policy.yaml").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
