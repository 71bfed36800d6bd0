"""Real processes for the reliability suite: the engine (`python -m portcullis.engine` on the demo model)
and `portcullis serve`, plus the gateway fixtures of tests/gateway reused as they are.

Everything here starts real programs on loopback or Unix sockets; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# The gateway suite's fixtures (stub engine, keys, in-process gateways) are reused, not copied.
from tests.gateway.conftest import (  # noqa: F401 - fixtures are found by name
    ENGINE_TOKEN,
    GatewayFactory,
    RunningGateway,
    _reset_stub,
    base_policy,
    gateways,
    gw,
    jwt_keys,
    redis_url,
    stub,
    whole_records,
)

REPO = Path(__file__).resolve().parents[2]
DEMO = "demo"
ENGINE_STARTUP_S = 240
# Small enough to start fast on two CPU cores, large enough for long prompts and streams; a
# small step budget spreads a long prompt's prefill over many steps (a window to disconnect in).
ENGINE_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "32MiB", "--max-num-batched-tokens", "64"]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)


def report(request: pytest.FixtureRequest, line: str) -> None:
    """A summary line in the test run's output, even without -s (fuzz counts, soak drift)."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def series(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            found[match[1]] = float(match[2])
    return found


def metric(values: dict[str, float], name: str, label: str = "") -> float:
    """The sum of `name`'s series whose labels contain `label` (e.g. 'finished_reason="abort"')."""
    return sum(v for k, v in values.items() if k.split("{")[0] == name and label in k)


@dataclass
class EngineProcess:
    """`python -m portcullis.engine` serving the demo model on a Unix socket, with the internal token."""

    proc: subprocess.Popen
    sock: Path
    log: Path

    def http(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url="http://engine",
                            headers={"authorization": f"Bearer {ENGINE_TOKEN}"}, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        with self.http() as client:
            return series(client.get("/metrics").text)

    def idle(self) -> bool:
        """No request running or waiting and no KV block held: every disconnect was cleaned up."""
        m = self.metrics()
        held = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        return all(metric(m, name) == 0 for name in held)

    def wait_idle(self, timeout: float = 10) -> None:
        wait_for(self.idle, timeout, f"the engine to free every block (last: {self._kv_state()})", every=0.1)

    def _kv_state(self) -> dict[str, float]:
        return {k.split("{")[0]: v for k, v in self.metrics().items() if k.startswith(("vllm:num_requests", "vllm:kv"))}

    def wait_healthy(self) -> None:
        wait_for(lambda: _healthy(self), ENGINE_STARTUP_S, f"the engine {self.sock.stem} to start", every=0.2)

    def stop(self) -> None:
        _end_group(self.proc)


def launch_engine(folder: Path, name: str = "engine", flags: Sequence[str] = ENGINE_FLAGS,
                  env: dict[str, str] | None = None) -> EngineProcess:
    """Start `python -m portcullis.engine` on the demo model at `folder/<name>.sock` (token `folder/token`)
    without waiting: launch several, then `wait_healthy` each, so they start side by side."""
    token = folder / "token"
    if not token.exists():
        token.write_text(ENGINE_TOKEN)
    sock, log = folder / f"{name}.sock", folder / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "portcullis.engine", "--uds", str(sock), "--token-file", str(token),
             "--served-model-name", DEMO, *flags],
            cwd=REPO, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    return EngineProcess(proc, sock, log)


def engine_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="ptc-rel-"))  # short: socket paths max out at 108


@contextlib.contextmanager
def healthy_engine(name: str = "engine", flags: Sequence[str] = ENGINE_FLAGS) -> Iterator[EngineProcess]:
    """A real engine, healthy, for the length of the block; stopped and its folder removed after."""
    folder = engine_folder()
    running = launch_engine(folder, name, flags)
    try:
        running.wait_healthy()
        yield running
    finally:
        running.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def engine() -> Iterator[EngineProcess]:
    """One real engine for the session's disconnect and fuzz tests (tests leave it idle)."""
    with healthy_engine() as running:
        yield running


def _healthy(engine: EngineProcess) -> bool:
    if engine.proc.poll() is not None:
        pytest.fail(f"the engine exited ({engine.proc.returncode}):\n{engine.log.read_text()[-3000:]}")
    try:
        with engine.http(timeout=2) as client:
            return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def _end_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def gw_engine(gateways: GatewayFactory, engine: EngineProcess) -> RunningGateway:  # noqa: F811
    """An in-process gateway (real loopback port) in front of the real engine."""
    policy = base_policy()
    policy["tenants"]["acme"]["models"] = [DEMO]
    policy["defaults"]["max_tokens"] = 1024
    return gateways.start(policy, engine_url=f"unix://{engine.sock}")


# ---- portcullis serve --------------------------------------------------------------------

@dataclass
class Served:
    """`portcullis serve` (demo model) with its printed admin key."""

    proc: subprocess.Popen
    key: str
    base: str
    home: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def children(self, marker: str) -> list[int]:
        """Live child processes whose command line holds `marker` (e.g. "-m portcullis.engine")."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _parent(int(entry)) == self.proc.pid and marker in _cmdline(int(entry)):
                found.append(int(entry))
        return found

    def audit(self) -> list[dict]:
        path = self.home / "audit.log"
        return whole_records(path.read_text()) if path.exists() else []

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(stat[1]) if stat[0] != "Z" else -1


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def start_serve(home: Path, *flags: str) -> Served:
    """Start `portcullis serve` on the demo model; return once the gateway is ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PORTCULLIS_ENGINE_TOKEN", "VLLM_API_KEY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "portcullis.cli", "serve", "--model", "demo", "--port", str(port), "--home", str(home),
         *ENGINE_FLAGS, *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    key, seen = None, []
    deadline = time.monotonic() + ENGINE_STARTUP_S
    while key is None:
        assert proc.poll() is None and time.monotonic() < deadline, "serve printed no key:\n" + "".join(seen)
        seen.append(proc.stdout.readline())
        if seen[-1].strip().startswith("ptc_"):
            key = seen[-1].strip()
    # Keep reading: a full pipe would block serve (and the engine, which shares its stdout).
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    served = Served(proc, key, f"http://127.0.0.1:{port}", home)
    wait_for(served.ready, 120, "the gateway to be ready", every=0.2)
    return served
