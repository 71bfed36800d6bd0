"""`portcullis serve` end to end: one command brings up engine + gateway, prints a working key
once, restarts a dead engine, refuses a busy port, and leaves no process behind on SIGTERM."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from portcullis.protocol.engine_flags import read_shared_flags
from tests.gateway.conftest import _reset_stub, gateways, jwt_keys, stub  # noqa: F401 - fixtures, by name

REPO = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max-model-len", "256", "--kv-cache-memory", "16MiB"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                parents[int(entry)] = int(stat[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == current]
        found += kids
        frontier += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(checkpoint_factory, tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-home")
    port = _free_port()
    model = str(checkpoint_factory("llama"))
    env = {k: v for k, v in os.environ.items() if k not in ("PORTCULLIS_ENGINE_TOKEN",)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.cli", "serve", model, "--port", str(port), "--home", str(home),
         "--served-model-name", "tiny", *ENGINE_FLAGS],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    lines = []
    key = None
    deadline = time.monotonic() + 240
    while key is None:
        assert proc.poll() is None, "serve exited early:\n" + "".join(lines)
        assert time.monotonic() < deadline, "serve did not print a key:\n" + "".join(lines)
        line = proc.stdout.readline()
        lines.append(line)
        if line.strip().startswith("ptc_"):
            key = line.strip()
    base = f"http://127.0.0.1:{port}"
    _wait(lambda: _ready(base), 120, "the gateway to be ready")
    yield {"proc": proc, "key": key, "base": base, "port": port, "home": home, "model": model, "out": lines}
    if proc.poll() is None:
        proc.kill()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_printed_key_works_with_the_openai_sdk(served):
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key=served["key"])
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    comp = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 6
    stream = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == comp.choices[0].text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason is not None


def test_an_agents_auto_tool_choice_works_out_of_the_box(served):
    """Issue 30: every agent framework sends tool_choice "auto"; `serve` used to answer 400 (vLLM's
    default), and this model's template has no tool format: it gets the generic one."""
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key=served["key"])
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    call = '{"name": "get_time", "arguments": {}}'
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[tool],
                                         tool_choice="auto", max_tokens=30,
                                         extra_body={"guided_regex": re.escape(call)})  # as a trained model would write it
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.tool_calls[0].function.name == "get_time"


def test_key_is_printed_once_and_stored_only_hashed(served):
    assert "".join(served["out"]).count(served["key"]) >= 1
    keys_file = (served["home"] / "keys.yaml").read_text()
    secret = served["key"].split(".", 1)[1]
    assert secret not in keys_file and "hmac-sha256$" in keys_file


def test_request_without_a_key_is_refused(served):
    r = httpx.post(served["base"] + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and "error" in r.json()


def test_second_serve_on_a_busy_port_fails_clearly(served, tmp_path):
    r = subprocess.run([sys.executable, "-m", "portcullis.cli", "serve", served["model"], "--port", str(served["port"]),
                        "--home", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{served['port']}" in r.stderr
    assert not (tmp_path / "policy.yaml").exists()  # refused before writing anything


def test_engine_death_gives_503_then_recovers(served):
    engines = [p for p in _descendants(served["proc"].pid) if "-m portcullis.engine" in _cmdline(p)]
    assert len(engines) == 1
    os.kill(engines[0], signal.SIGKILL)
    headers = {"Authorization": f"Bearer {served['key']}"}
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    _wait(lambda: httpx.post(served["base"] + "/v1/completions", json=body, headers=headers, timeout=10).status_code == 503,
          30, "a 503 while the engine is down")
    r = httpx.post(served["base"] + "/v1/completions", json=body, headers=headers, timeout=10)
    assert r.status_code in (503, 200)
    if r.status_code == 503:
        assert "retry-after" in r.headers and "error" in r.json()
    _wait(lambda: httpx.post(served["base"] + "/v1/completions", json=body, headers=headers, timeout=30).status_code == 200,
          180, "the restarted engine to serve again")


def test_sigterm_leaves_no_process_behind(served):
    proc = served["proc"]
    ours = _descendants(proc.pid)
    assert any("-m portcullis.engine" in _cmdline(p) for p in ours) and any("gateway" in _cmdline(p) for p in ours)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    _wait(lambda: not any(_alive(p) for p in ours), 20, "every child to exit")
    assert not any(_alive(p) for p in ours)


def test_sigkill_of_the_supervisor_leaves_no_orphan(checkpoint_factory, tmp_path):
    """Children watch their parent (PR_SET_PDEATHSIG): even `kill -9` of serve stops them, and the
    next serve removes the runtime folder (engine token included) the killed one left behind."""
    port = _free_port()
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.cli", "serve", str(checkpoint_factory("llama")), "--port", str(port),
         "--home", str(tmp_path), *ENGINE_FLAGS],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: _ready(f"http://127.0.0.1:{port}"), 240, "the gateway to be ready")
        ours = _descendants(proc.pid)
        assert len(ours) >= 2
    finally:
        proc.kill()
        proc.wait()
    _wait(lambda: not any(_alive(p) for p in ours), 60, "the orphans to exit")
    (left,) = run.glob("portcullis-*")
    assert (left / "engine-token").exists()  # kill -9 skips serve's own clean-up
    with socket.socket() as busy:  # the next serve cleans up first, even one that cannot start
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        again = subprocess.run([sys.executable, "-m", "portcullis.cli", "serve", "--port", str(busy.getsockname()[1]),
                                "--home", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=60)
    assert again.returncode == 2 and f"removed {left}" in again.stderr
    assert list(run.iterdir()) == []


def test_only_runtime_folders_of_dead_serves_are_removed(tmp_path, monkeypatch):
    from portcullis.supervisor import serve

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    def folder(name: str, pid: int | None) -> Path:
        made = tmp_path / name
        made.mkdir(mode=0o700)
        (made / "engine-token").write_text("secret")
        if pid is not None:
            (made / "serve.pid").write_text(f"{pid}\n")
        return made

    dead, live = folder("portcullis-dead", gone.pid), folder("portcullis-live", os.getpid())
    unmarked, other = folder("portcullis-unmarked", None), folder("not-ours", gone.pid)
    (tmp_path / "portcullis-link").symlink_to(other)  # a link is never followed
    serve._remove_abandoned_runtime_dirs()
    assert not dead.exists()
    assert live.exists() and unmarked.exists() and other.exists() and (tmp_path / "portcullis-link").is_symlink()
    runtime = serve._runtime_dir()
    assert runtime.stat().st_mode & 0o777 == 0o700
    assert (runtime / "serve.pid").read_text().strip() == str(os.getpid())


async def test_starter_policy_admits_a_full_batch_of_the_engine(gateways, stub):  # noqa: F811
    """The first-run policy sizes its limits by --max-num-seqs: as many concurrent requests as the
    engine batches all get 200 (the old starter capped 32, so the 33rd got 429)."""
    from portcullis.supervisor import serve

    seqs = 48
    policy = yaml.safe_load(serve.starter_policy(Path("policy.yaml"), read_shared_flags(["--max-num-seqs", str(seqs)]).max_num_seqs))
    policy["tenants"] = {"acme": policy["tenants"]["default"], "globex": {}}  # the fixture keys' tenants
    gw = gateways.start(policy)
    stub.chunk_delay_s = 0.1  # each stream lasts about a second: all of them are in flight at once
    body = {"model": "demo", "prompt": "x", "max_tokens": 8, "stream": True}
    async with gw.client(limits=httpx.Limits(max_connections=seqs)) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=body, headers=gw.auth())
                                           for _ in range(seqs)))
    assert [r.status_code for r in responses] == [200] * seqs
    assert stub.streams_finished == seqs


async def test_starter_policy_serves_anthropic_clients(gateways, stub):  # noqa: F811
    """Claude Code and the Anthropic SDK work against a first-run gateway: the starter policy
    lists /v1/messages and its count_tokens, and the key goes in `x-api-key`."""
    from portcullis.supervisor import serve

    policy = yaml.safe_load(serve.starter_policy(Path("policy.yaml"), 8))
    policy["tenants"] = {"acme": policy["tenants"]["default"], "globex": {}}  # the fixture keys' tenants
    gw = gateways.start(policy)
    headers = {"x-api-key": gw.keys["alice"], "anthropic-version": "2023-06-01"}
    conversation = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}
    async with gw.client() as client:
        reply = await client.post("/v1/messages", json={**conversation, "max_tokens": 4}, headers=headers)
        counted = await client.post("/v1/messages/count_tokens", json=conversation, headers=headers)
    assert reply.status_code == 200 and reply.json()["type"] == "message"
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


async def test_starter_policy_serves_responses_clients(gateways, stub):  # noqa: F811
    """Codex and the OpenAI Agents SDK work against a first-run gateway: the starter policy
    lists /v1/responses, and the reply's usage is audited."""
    from portcullis.supervisor import serve

    policy = yaml.safe_load(serve.starter_policy(Path("policy.yaml"), 8))
    policy["tenants"] = {"acme": policy["tenants"]["default"], "globex": {}}  # the fixture keys' tenants
    gw = gateways.start(policy)
    body = {"model": "demo", "input": "Hi", "max_output_tokens": 4}
    async with gw.client() as client:
        reply, record = await gw.call(client, "POST", "/v1/responses", json=body, headers=gw.auth("alice"))
    assert reply.status_code == 200 and reply.json()["object"] == "response"
    assert record["completion_tokens"] == reply.json()["usage"]["output_tokens"] == 4


def test_starter_policy_is_valid_and_scales_with_the_engine(tmp_path):
    from portcullis.gateway.policy.loader import load_policy
    from portcullis.supervisor import serve

    for flags, seqs in ((["--max-model-len", "256"], 256), (["--max-num-seqs", "8"], 8), (["--max-num-seqs=1024"], 1024)):
        path = tmp_path / f"{seqs}.yaml"
        path.write_text(serve.starter_policy(path, read_shared_flags(flags).max_num_seqs))
        limits = load_policy(path).policy.tenants["default"].limits
        assert limits.concurrent_requests == seqs
        assert limits.requests_per_minute >= max(600, 60 * seqs)  # at least one request a second per slot
        assert limits.tokens_per_minute >= 1_000_000


def test_an_older_policy_capped_below_the_batch_is_pointed_out(tmp_path):
    from portcullis.supervisor import serve

    path = tmp_path / "policy.yaml"
    path.write_text(serve.starter_policy(path, 32))
    (warning,) = serve._limits_below_batch(path, 256)
    assert "tenants.default.limits.concurrent_requests" in warning and "256" in warning
    assert serve._limits_below_batch(path, 32) == []


def test_static_api_key_like_vllm(checkpoint_factory, tmp_path):
    """`VLLM_API_KEY` (or --api-key) works as vLLM users expect, and is stored only hashed."""
    port = _free_port()
    static = "my-own-static-key-0123456789"
    env = {**os.environ, "VLLM_API_KEY": static}
    short = subprocess.run([sys.executable, "-m", "portcullis.cli", "serve", "--api-key", "short", "--home", str(tmp_path)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "at least 16 characters" in short.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.cli", "serve", str(checkpoint_factory("llama")), "--port", str(port),
         "--home", str(tmp_path), "--served-model-name", "tiny", *ENGINE_FLAGS],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(lambda: _ready(base), 240, "the gateway to be ready")
        client = openai.OpenAI(base_url=base + "/v1", api_key=static)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        wrong = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x"},
                           headers={"Authorization": "Bearer my-own-static-key-0123456780"})
        assert wrong.status_code == 401
        assert static not in (tmp_path / "keys.yaml").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    assert "ptc_" not in out  # no admin key was generated when the operator brought their own


def test_a_first_run_whose_engine_fails_still_prints_its_key(tmp_path):
    """The admin key is printed as soon as it is made, before the engine starts: a first run
    whose engine fails (a wrong model path) no longer strands the key in keys.yaml unseen."""
    from portcullis.gateway.auth.keys import secret_matches, split_key

    r = subprocess.run([sys.executable, "-m", "portcullis.cli", "serve", str(tmp_path / "no-such-model"),
                        "--port", str(_free_port()), "--home", str(tmp_path / "home"), *ENGINE_FLAGS],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr
    (key,) = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("ptc_")]
    key_id, secret = split_key(key)
    (record,) = yaml.safe_load((tmp_path / "home" / "keys.yaml").read_text())["keys"]
    assert record["id"] == key_id and secret_matches(secret, record["hash"])
    assert f"Bearer {key}" in r.stdout and "max_tokens" in r.stdout.split("curl", 1)[1].split("\n\n", 1)[0]


def test_a_later_run_says_how_to_get_a_key(tmp_path, capsys):
    """A run after the first prints no key (it was shown once), but one line that makes one."""
    import argparse

    from portcullis.supervisor import serve

    policy = tmp_path / "policy.yaml"
    policy.write_text(serve.starter_policy(policy, 8))
    args = argparse.Namespace(ssl_certfile=None, host="127.0.0.1", port=8000, model="m", api_key=None)
    serve._announce(args, "m", None, policy)
    out = capsys.readouterr().out
    assert f"portcullis keys --policy {policy} create --principal NAME --tenant default" in out
    args.api_key = "my-own-static-key-0123456789"  # the operator brought their own: nothing to hint
    serve._announce(args, "m", None, policy)
    assert "portcullis keys" not in capsys.readouterr().out


def test_the_printed_curl_line_asks_for_a_short_reply(capsys):
    """The toy model would otherwise answer the curl line with hundreds of tokens."""
    import argparse

    from portcullis.supervisor import serve

    args = argparse.Namespace(ssl_certfile=None, host="127.0.0.1", port=8000, model=None, api_key=None)
    serve._print_key(args, "demo", "ptc_abc.def", Path("policy.yaml"))
    curl = capsys.readouterr().out.split("curl", 1)[1].split("\n\n", 1)[0]
    body = json.loads(curl.split("-d '", 1)[1].rsplit("'", 1)[0])
    assert body["model"] == "demo" and 1 <= body["max_tokens"] <= 64
