"""The children `portcullis serve` starts and watches: engines and the gateway, as programs.

Each child runs in its own session (so stopping one ends its whole process group, tensor-parallel
workers included) and dies with the supervisor even if that is killed outright
(PR_SET_PDEATHSIG). Shared by the single-model serve (`serve`) and the fleet (`fleet`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ENGINE_READY_TIMEOUT_S = 300.0
GATEWAY_DRAIN_TIMEOUT_S = 35.0
MAX_BACKOFF_S = 30.0


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: float = field(default=0.0)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent(os.getpid()),
                                     start_new_session=True)
        self.started = time.monotonic()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float) -> None:
        if not self.running():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole group: TP workers included
            self.proc.wait()


def _die_with_parent(parent: int):
    def setup() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    return setup


def log(message: str) -> None:
    print(f"portcullis serve: {message}", file=sys.stderr, flush=True)


def install_signal_handlers() -> list[int]:
    stopping: list[int] = []

    def handler(signum, frame) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stopping


def wait_for_engine(engine: Child, sock: Path, stopping: list[int]) -> bool:
    import httpx

    deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=2)
    with client:
        while not stopping:
            if not engine.running():
                log(f"the engine exited with code {engine.proc.returncode} before it was ready (see its log above)")
                return False
            if time.monotonic() > deadline:
                log(f"the engine was not ready after {ENGINE_READY_TIMEOUT_S:.0f} s; giving up")
                return False
            try:
                if sock.exists() and client.get("/health").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    return False
