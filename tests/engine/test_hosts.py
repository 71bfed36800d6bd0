"""The engine across hosts: two network namespaces joined by a veth pair stand for two machines on a
private network. Node 0 runs `portcullis serve` (gateway, engine server, rank 0), node 1 a
`--headless` engine holding the second pipeline stage. Also: what the rendezvous refuses."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portcullis.engine.config import EngineConfig
from portcullis.engine.server.cli import main
from portcullis.engine.worker.rendezvous import master_store

REPO = Path(__file__).resolve().parents[2]
KEY = "two-hosts-test-key-0123456789"
NODE0, NODE1 = "10.250.7.1", "10.250.7.2"
ENGINE_FLAGS = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", NODE0, "--master-port", "29517",
                "--max-model-len", "256", "--kv-cache-memory", "16MiB"]


def _netns_available() -> bool:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    probe = f"ptc-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


NETNS = _netns_available()
if os.environ.get("CI") and not NETNS:  # CI runs as root with iproute2 (.ci/run): never skip there
    raise RuntimeError("the two-host test needs `ip netns` (root, iproute2) and CI has it")


@pytest.fixture
def hosts():
    """Two namespaces, `a` (NODE0) and `b` (NODE1), a veth pair between them; removed after."""
    a, b = f"ptc-a-{os.getpid()}", f"ptc-b-{os.getpid()}"
    for cmd in (["netns", "add", a], ["netns", "add", b], ["link", "add", "ptc-va", "netns", a, "type", "veth",
                "peer", "name", "ptc-vb", "netns", b]):
        subprocess.run(["ip", *cmd], check=True)
    for ns, dev, addr in ((a, "ptc-va", NODE0), (b, "ptc-vb", NODE1)):
        for cmd in (["addr", "add", f"{addr}/30", "dev", dev], ["link", "set", dev, "up"], ["link", "set", "lo", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
    yield a, b
    for ns in (a, b):
        for pid in _pids_in(ns):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns])


def _pids_in(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _in(ns: str, *argv: str, **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PORTCULLIS_ENGINE_TOKEN"}
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=REPO, env=env, **kwargs)


# Run inside node 0's namespace: one request through the gateway; prints the status, the
# retry-after header and, streamed, each server-sent line as it comes.
CLIENT = """
import sys, httpx
stream, max_tokens = sys.argv[1] == "stream", int(sys.argv[2])
body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
headers = {"authorization": "Bearer " + sys.argv[3]}
try:
    with httpx.stream("POST", "http://127.0.0.1:8000/v1/completions", json=body, headers=headers, timeout=120) as r:
        print(r.status_code, r.headers.get("retry-after"), flush=True)
        for line in r.iter_lines():
            print(line, flush=True)
except httpx.TransportError as exc:
    print("transport", type(exc).__name__, flush=True)
"""


def _request(ns: str, max_tokens: int = 8) -> tuple[str, list[str]]:
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, "plain", str(max_tokens), KEY],
                         capture_output=True, text=True, timeout=180).stdout.splitlines()
    return out[0], out[1:]


@pytest.mark.skipif(not NETNS, reason="needs root and `ip netns` (CI has both and never skips)")
def test_two_hosts_serve_through_the_gateway_and_recover_when_a_node_dies(hosts, checkpoint_factory, tmp_path):
    a, b = hosts
    model = str(checkpoint_factory("llama"))
    serve = _in(a, sys.executable, "-m", "portcullis.cli", "serve", model, "--home", str(tmp_path / "home"),
                "--api-key", KEY, "--served-model-name", "tiny", *ENGINE_FLAGS, "--node-rank", "0",
                stdout=subprocess.DEVNULL, stderr=(tmp_path / "node0.log").open("w"))
    node1 = _in(b, sys.executable, "-m", "portcullis.engine", model, *ENGINE_FLAGS, "--node-rank", "1", "--headless",
                stdout=subprocess.DEVNULL, stderr=(tmp_path / "node1.log").open("w"))
    try:
        status, lines = _wait_for_success(a, serve, 240)
        text = json.loads(lines[0])["choices"][0]["text"]
        # Mid-stream, node 1's rank dies: the client is told, the group restarts, service resumes.
        stream = _in(a, sys.executable, "-c", CLIENT, "stream", "200", KEY, stdout=subprocess.PIPE, text=True)
        assert stream.stdout.readline().startswith("200")
        for _ in range(3):
            assert stream.stdout.readline().startswith("data: {")
            stream.stdout.readline()  # the blank line after each event
        for pid in _ranks_of(node1.pid):
            os.kill(pid, signal.SIGKILL)
        rest = stream.communicate(timeout=120)[0]
        assert '"error"' in rest and "data: [DONE]" in rest and "Connection closed" not in rest
        status, lines = _wait_for_success(a, serve, 240, refusals_are_503=True)
        assert json.loads(lines[0])["choices"][0]["text"] == text  # the same greedy text as before
    finally:
        for proc in (serve, node1):
            proc.send_signal(signal.SIGTERM)
        for proc in (serve, node1):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    deadline = time.monotonic() + 20
    while (_pids_in(a) or _pids_in(b)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pids_in(a) and not _pids_in(b), "a process was left on a host"


def _wait_for_success(ns: str, serve: subprocess.Popen, timeout_s: float, refusals_are_503: bool = False):
    deadline = time.monotonic() + timeout_s
    while True:
        assert serve.poll() is None, "serve exited"
        status, lines = _request(ns)
        if status.startswith("200"):
            return status, lines
        if refusals_are_503 and not status.startswith("transport"):
            code, retry_after = status.split()
            assert code == "503" and retry_after.isdigit(), status  # the gateway says when to come back
        assert time.monotonic() < deadline, f"no success within {timeout_s} s: {status} {lines}"
        time.sleep(1)


def _ranks_of(pid: int) -> list[int]:
    """The headless launcher's rank processes (not multiprocessing's resource tracker)."""
    ranks = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                cmdline = open(f"/proc/{entry}/cmdline").read()
            except OSError:
                continue
            if int(stat[1]) == pid and "spawn_main" in cmdline:
                ranks.append(int(entry))
    assert ranks, "node 1 runs no rank"
    return ranks


# -- what the rendezvous refuses ------------------------------------------------------------------------
def test_a_public_master_address_is_refused_unless_allowed(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    with pytest.raises(ValueError, match="public address"):
        EngineConfig(path, pipeline_parallel_size=2, nnodes=2, master_addr="8.8.8.8", master_port=29500)
    EngineConfig(path, pipeline_parallel_size=2, nnodes=2, master_addr="8.8.8.8", master_port=29500,
                 allow_public_master_addr=True)
    with pytest.raises(ValueError, match="every interface"):
        EngineConfig(path, pipeline_parallel_size=2, nnodes=2, master_addr="0.0.0.0", master_port=29500,
                     allow_public_master_addr=True)


@pytest.mark.parametrize("settings, problem", [
    (dict(pipeline_parallel_size=2, nnodes=3, master_port=29500), "split evenly over 3 nodes"),
    (dict(pipeline_parallel_size=2, nnodes=2, node_rank=2, master_port=29500), "node_rank must be in"),
    (dict(pipeline_parallel_size=2, nnodes=2), "master_port"),
])
def test_host_settings_that_cannot_work_are_refused(checkpoint_factory, settings, problem):
    with pytest.raises(ValueError, match=problem):
        EngineConfig(str(checkpoint_factory("llama")), **settings)


@pytest.mark.parametrize("flags, problem", [
    (["--distributed-executor-backend", "ray"], "ray is not supported"),
    (["--nnodes", "2", "--node-rank", "1", "--master-port", "29500", "-pp", "2"], "runs --headless"),
    (["--headless"], "nodes past the first"),
])
def test_cli_refuses_what_a_node_cannot_do(checkpoint_factory, capsys, monkeypatch, flags, problem):
    monkeypatch.setattr("portcullis.engine.server.cli.configure_logging", lambda fmt, force: None)
    assert main([str(checkpoint_factory("llama")), "--uds", "/nonexistent/x.sock", "--no-token", *flags]) == 2
    assert problem in capsys.readouterr().err


def _listening(port: int) -> list[str]:
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [fields[1] for fields in rows if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port]


def test_the_rendezvous_store_listens_only_on_the_address_given_until_freed():
    store = master_store("127.0.0.1", 0, 2)
    port = store.port
    assert _listening(port) == [f"0100007F:{port:04X}"]  # 127.0.0.1 only, not 0.0.0.0
    del store
    assert _listening(port) == []  # the port is free for the next engine


def test_a_node_with_other_settings_is_refused_by_name(checkpoint_factory, tmp_path):
    """Node 1 started with another max_model_len: node 0 stops with both settings side by side."""
    path = str(checkpoint_factory("llama"))
    flags = ["-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29519",
             "--kv-cache-memory", "16MiB"]
    env = {k: v for k, v in os.environ.items() if k != "PORTCULLIS_ENGINE_TOKEN"}
    node1 = subprocess.Popen([sys.executable, "-m", "portcullis.engine", path, *flags, "--node-rank", "1", "--headless",
                              "--max-model-len", "128"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(ValueError, match="settings differ.*max_model_len=128"):
            _engine_with_two_nodes(path, max_model_len=256)
    finally:
        node1.send_signal(signal.SIGTERM)
        node1.wait(timeout=60)


def _engine_with_two_nodes(path: str, max_model_len: int):
    from portcullis.engine.core.engine_core import EngineCore

    config = EngineConfig(path, pipeline_parallel_size=2, nnodes=2, master_port=29519, max_model_len=max_model_len,
                          kv_cache_memory=16 << 20)
    return EngineCore(config)


def test_a_rank_lost_while_idle_ends_the_engine_for_its_supervisor(checkpoint_factory, tmp_path):
    """No request needs to fail first: the next heartbeat finds the rank gone and the engine exits
    (code 1, for `serve`, systemd or Kubernetes to restart the group)."""
    env = {k: v for k, v in os.environ.items() if k != "PORTCULLIS_ENGINE_TOKEN"}
    env["PORTCULLIS_DISTRIBUTED_TIMEOUT_S"] = "3"  # a heartbeat each second while idle
    sock = tmp_path / "engine.sock"
    engine = subprocess.Popen([sys.executable, "-m", "portcullis.engine", str(checkpoint_factory("llama")), "--uds",
                               str(sock), "--no-token", "--pipeline-parallel-size", "2", "--max-model-len", "256",
                               "--kv-cache-memory", "16MiB"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert engine.poll() is None and time.monotonic() < deadline, "the engine did not come up"
            time.sleep(0.2)
        (rank,) = _ranks_of(engine.pid)
        os.kill(rank, signal.SIGKILL)
        _, err = engine.communicate(timeout=30)
    finally:
        if engine.poll() is None:
            engine.kill()
    assert engine.returncode == 1
    assert "heartbeat to the other ranks failed" in err
