"""One `portcullis serve` for the whole client suite, with default flags, on a random-weight
checkpoint: the clients here are libraries nobody in this project wrote, talking to it as a user's
code would (base URL and the printed key, nothing else)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="session")
def served(checkpoint_factory, tmp_path_factory):
    """`portcullis serve CHECKPOINT --served-model-name tiny`: its base URL and the printed key."""
    home = tmp_path_factory.mktemp("clients-home")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PORTCULLIS_ENGINE_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.cli", "serve", str(checkpoint_factory("llama")), "--port", str(port),
         "--home", str(home), "--served-model-name", MODEL],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    base, key, lines = f"http://127.0.0.1:{port}", None, []
    try:
        deadline = time.monotonic() + 240
        while key is None:
            assert proc.poll() is None, "serve exited early:\n" + "".join(lines)
            assert time.monotonic() < deadline, "serve printed no key:\n" + "".join(lines)
            lines.append(proc.stdout.readline())
            if lines[-1].strip().startswith("ptc_"):
                key = lines[-1].strip()
        while not _ready(base):
            assert proc.poll() is None and time.monotonic() < deadline, "the gateway never got ready"
            time.sleep(0.2)
        yield {"base": base, "key": key}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
