"""The gateway runs without the engine's stack: its base install has no torch, transformers,
triton, xgrammar, tokenizers, safetensors or numpy (`make test-gateway` runs its tests in such a
venv; this test proves it in every run of the suite)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from .conftest import ENGINE_TOKEN, ROOT, base_policy, write_policy_file

# `python -c` with the refusal installed before anything of ours is imported.
GATEWAY = ("import sys, tests.support.no_torch; from portcullis.cli import main; "
           "sys.exit(main(sys.argv[1:]))")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"the gateway did not start: {proc.communicate(timeout=10)[1][-3000:]}")


def test_the_gateway_serves_with_the_engine_stack_unimportable(gateways, tmp_path):
    folder = tmp_path / "gw"
    folder.mkdir()
    keys = gateways._write_keys(folder)
    (folder / "jwks.json").write_text('{"keys": []}')
    write_policy_file(folder / "policy.yaml", base_policy())
    port = _free_port()
    env = {**os.environ, "PORTCULLIS_ENGINE_TOKEN": ENGINE_TOKEN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY, "gateway", "--policy", str(folder / "policy.yaml"),
                             "--engine-url", f"unix://{gateways.stub.socket}", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        headers = {"authorization": f"Bearer {keys['alice']}"}
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        chat = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=20)
        streamed = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "hi", "stream": True},
                              headers=headers, timeout=20)
        refused = httpx.post(url + "/v1/completions", json={"model": "secret", "prompt": "hi"}, headers=headers,
                             timeout=20)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert chat.status_code == 200 and chat.json()["choices"], chat.text
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed", refused.text
    assert "ModuleNotFoundError" not in err, err[-3000:]
    assert proc.returncode in (0, -signal.SIGTERM), err[-3000:]  # uvicorn re-raises the signal it drained on


def test_the_refusal_is_real():
    """The test above proves something only if the refusal works: torch cannot load under it."""
    code = ("import tests.support.no_torch\ntry:\n    from torch import nn\nexcept ModuleNotFoundError:\n"
            "    raise SystemExit(7)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=60).returncode == 7


def test_engine_commands_name_the_missing_extra():
    for command in ("serve", "engine"):
        done = subprocess.run([sys.executable, "-c", GATEWAY, command], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        assert done.returncode == 2 and "pip install 'portcullis-llm[engine]'" in done.stderr, done.stderr
