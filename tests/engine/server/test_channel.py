"""The private channel: a 0600 Unix socket by default, TCP only with a token, and the command
line that starts it all (`python -m portcullis.engine`, which `portcullis engine` runs)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.server import ServerSettings
from portcullis.engine.server.cli import (
    UsageError,
    build_parser,
    generation_defaults,
    human_int,
    main,
    resolve_model,
    server_settings,
)
from portcullis.engine.server.run import ListenError, bind_unix_socket

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named
REPO = Path(__file__).resolve().parents[3]


def test_unix_socket_is_created_mode_0600(server):
    mode = stat.S_IMODE(os.stat(server.uds).st_mode)
    assert mode == 0o600


def test_stale_socket_is_replaced_but_live_one_and_other_files_are_not(tmp_path, server):
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # bound, never listening: what a crashed server leaves
    bind_unix_socket(stale).close()
    with pytest.raises(ListenError, match="already listening"):
        bind_unix_socket(server.uds)
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(ListenError, match="not a socket"):
        bind_unix_socket(plain)


def test_tcp_server_with_token(server_factory):
    tcp = server_factory(tcp=True)
    client = tcp.client()
    out = client.completions.create(model=MODEL_NAME, prompt="over tcp", max_tokens=3)
    assert out.usage.completion_tokens == 3
    with tcp.http(token="nope") as http:
        assert http.get("/v1/models").status_code == 401


def test_settings_refuse_tcp_without_token_and_no_token_without_the_flag():
    with pytest.raises(ValidationError, match="refusing to listen on TCP without an internal token"):
        ServerSettings(served_model_names=["m"], host="0.0.0.0", port=8001)
    with pytest.raises(ValidationError, match="no internal token"):
        ServerSettings(served_model_names=["m"], uds=Path("/tmp/x.sock"))
    assert ServerSettings(served_model_names=["m"], uds=Path("/tmp/x.sock"), allow_no_token=True).token is None


def test_cli_flags_follow_vllm_serve(tmp_path, monkeypatch):
    monkeypatch.delenv("PORTCULLIS_ENGINE_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("a-long-enough-secret\n")
    args = build_parser().parse_args([
        "some/model", "--host", "10.0.0.5", "--port", "9000", "--token-file", str(token_file),
        "--served-model-name", "a", "b", "--max-model-len", "4k", "--kv-cache-memory", "64MiB",
        "--no-enable-prefix-caching", "-tp", "1", "--max-waiting", "7",
    ])
    assert (args.max_model_len, args.kv_cache_memory, args.enable_prefix_caching) == (4000, 64 << 20, False)
    s = server_settings(args, args.served_model_name, generation_defaults("vllm", tmp_path))
    assert (s.host, s.port, s.uds, s.max_waiting) == ("10.0.0.5", 9000, None, 7)
    assert s.token.get_secret_value() == "a-long-enough-secret" and s.served_model_names == ["a", "b"]
    assert human_int("2GiB") == 2 << 30 and human_int("1.5k") == 1500


def test_no_model_means_the_demo_model_served_as_demo():
    assert resolve_model(build_parser().parse_args([])) == (str(DEMO_MODEL_DIR), ["demo"])
    assert resolve_model(build_parser().parse_args(["org/model"])) == ("org/model", ["org/model"])
    args = build_parser().parse_args(["org/model", "--served-model-name", "m"])
    assert resolve_model(args) == ("org/model", ["m"])


def test_generation_config_auto_gives_request_defaults(tmp_path):
    # Qwen2.5-Coder-Instruct's generation_config.json, as vLLM applies it
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05}))
    d = generation_defaults("auto", tmp_path)
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.min_p) == (0.7, 0.8, 20, 1.1, 0.05)
    assert generation_defaults("vllm", tmp_path).temperature == 1.0
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 0, "min_p": 2}))
    with pytest.raises(UsageError, match="repetition_penalty, min_p|min_p, repetition_penalty"):
        generation_defaults("auto", tmp_path)
    assert generation_defaults("auto", tmp_path / "missing").temperature == 1.0


def test_cli_refuses_unsafe_or_unavailable_setups_before_loading_anything(server_model, monkeypatch, capsys):
    monkeypatch.delenv("PORTCULLIS_ENGINE_TOKEN", raising=False)
    assert main([str(server_model), "--port", "8123"]) == 2
    assert "refusing to listen on TCP without an internal token" in capsys.readouterr().err
    assert main([str(server_model), "--port", "8123", "--no-token"]) == 2
    assert "only allowed on a Unix socket" in capsys.readouterr().err
    assert main([str(server_model), "--uds", "/nonexistent/x.sock"]) == 2
    assert "no internal token" in capsys.readouterr().err
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", "short")
    assert main([str(server_model), "--uds", "/nonexistent/x.sock"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", "a-long-enough-token")
    monkeypatch.setattr("portcullis.engine.server.cli.configure_logging", lambda fmt, force: None)  # leave this process's logging be
    assert main([str(server_model), "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size=3 must divide" in capsys.readouterr().err
    assert main(["/nonexistent/model", "--uds", "/nonexistent/x.sock"]) == 2
    assert "cannot load model" in capsys.readouterr().err


def _start_cli(model, sock, token: str, *flags: str) -> tuple[subprocess.Popen, httpx.Client]:
    """`python -m portcullis.engine` on a private socket, once it answers /health."""
    token_file = sock.parent.parent / f"{sock.stem}-token"
    token_file.write_text(token)
    environ = {k: v for k, v in os.environ.items() if k != "PORTCULLIS_ENGINE_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.engine", str(model), "--uds", str(sock), "--token-file", str(token_file),
         "--max-model-len", "256", "--kv-cache-memory", "16MiB", *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
    )
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=30)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the engine did not come up"
        try:
            if http.get("/health").status_code == 200:
                return proc, http
        except httpx.TransportError:
            time.sleep(0.2)


def test_cli_serves_on_a_private_socket_logs_and_stops_cleanly(server_model, tmp_path):
    sock = tmp_path / "run" / "engine.sock"
    proc, http = _start_cli(server_model, sock, "cli-token-0123456789", "--served-model-name", "cli-model",
                            "--status-interval", "0.2")
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
        headers = {"authorization": "Bearer cli-token-0123456789", "x-request-id": "cli-req-1"}
        r = http.post("/v1/completions", json={"model": "cli-model", "prompt": "hi", "max_tokens": 40,
                                               "ignore_eos": True}, headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        time.sleep(0.5)  # let a status line come out
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not sock.exists()
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    events = {line["event"]: line for line in lines}
    assert events["engine ready"]["listen"] == f"unix:{sock}"
    done = events["request finished"]
    # The client's id, made unique in the engine, then the choice's index.
    assert re.fullmatch(r"cli-req-1-\d+-0", done["request_id"]) and done["completion_tokens"] == 40
    assert done["prompt_tokens"] > 0 and done["ttft_s"] >= 0 and done["e2e_s"] >= done["ttft_s"]
    assert "cached_tokens" in done
    assert "engine status" in events and "generation_tokens_per_s" in events["engine status"]
    assert "cli-token-0123456789" not in err


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_cli_with_two_ranks_serves_and_leaves_no_worker(server_model, tmp_path, flag):
    proc, http = _start_cli(server_model, tmp_path / "tp" / "tp.sock", "tp-token-0123456789", flag, "2")
    try:
        workers = _children(proc.pid)
        assert workers, "expected a worker process (rank 1)"
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True},
                      headers={"authorization": "Bearer tp-token-0123456789"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def _children(pid: int) -> list[int]:
    """Descendants of `pid` that are Python processes (the spawned TP workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return [c for c in out if "multiprocessing" in open(f"/proc/{c}/cmdline").read().replace("\0", " ")]


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
