"""`portcullis gateway --workers 2`: a scrape of /gateway/metrics counts every worker's requests,
whichever worker answers it, and the workers' metric files are removed when the gateway stops.
It serves HTTPS, so each worker also builds its TLS context from the flags it was handed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from .conftest import (
    ENGINE_TOKEN,
    ROOT,
    _free_port,
    base_policy,
    wait_for_workers,
    write_policy_file,
)
from .test_tls import CertAuthority

REQUESTS_TOTAL = re.compile(r"^portcullis_gateway_requests_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def _requests_total(text: str) -> float:
    return sum(float(value) for value in REQUESTS_TOTAL.findall(text))


def test_a_scrape_counts_the_requests_of_every_worker(gateways, tmp_path):
    folder, scratch = tmp_path / "gw", tmp_path / "tmp"
    folder.mkdir()
    scratch.mkdir()
    keys = gateways._write_keys(folder)
    (folder / "jwks.json").write_text('{"keys": []}')
    write_policy_file(folder / "policy.yaml", base_policy())
    port, ca = _free_port(), CertAuthority()
    cert, key = ca.issue("gateway.test", ip=("127.0.0.1",)).write(tmp_path, "server")
    verify = ca.client_context()
    env = {**os.environ, "PORTCULLIS_ENGINE_TOKEN": ENGINE_TOKEN, "TMPDIR": str(scratch),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "portcullis.cli", "gateway", "--policy", str(folder / "policy.yaml"),
                             "--engine-url", f"unix://{gateways.stub.socket}", "--port", str(port), "--workers", "2",
                             "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"https://127.0.0.1:{port}"
    try:
        wait_for_workers(folder / "audit.log", proc, 2)
        [metrics_dir] = scratch.glob("portcullis-metrics-*")
        assert oct(metrics_dir.stat().st_mode & 0o777) == "0o700"
        headers = {"authorization": f"Bearer {keys['alice']}", "connection": "close"}  # a new connection each

        def one(_: int) -> int:
            return httpx.get(url + "/v1/models", headers=headers, timeout=30, verify=verify).status_code

        sent = 0
        with ThreadPoolExecutor(8) as pool:
            # Until both workers have answered some (each writes its own counter file).
            while len(list(metrics_dir.glob("counter_*.db"))) < 2 and sent < 400:
                assert set(pool.map(one, range(40))) == {200}
                sent += 40
        assert len(list(metrics_dir.glob("counter_*.db"))) == 2, "the requests all went to one worker"
        admin = {"authorization": f"Bearer {keys['root']}", "connection": "close"}

        def scrape() -> float:
            response = httpx.get(url + "/gateway/metrics", headers=admin, timeout=30, verify=verify)
            assert response.status_code == 200
            return _requests_total(response.text)

        # A request's line (and count) lands just after its response has gone out, so the last
        # of them may still be on its way; each scrape counts itself before it answers.
        scrapes, deadline = 1, time.monotonic() + 10
        while (total := scrape()) < sent + scrapes and time.monotonic() < deadline:
            scrapes += 1
            time.sleep(0.05)
        assert total == sent + scrapes
        for _ in range(4):  # whichever worker answers
            scrapes += 1
            assert scrape() == sent + scrapes
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert not list(scratch.glob("portcullis-metrics-*")), "the metrics folder outlived the gateway"



def _in_flight_file(folder: Path, pid: int, value: float, kind: str = "gauge_livesum") -> None:
    """What a worker's prometheus_client writes for the in-flight gauge (or a counter)."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    name = "portcullis_gateway_in_flight" if kind == "gauge_livesum" else "portcullis_gateway_requests"
    sample = name if kind == "gauge_livesum" else name + "_total"
    store = MmapedDict(str(folder / f"{kind}_{pid}.db"))
    store.write_value(mmap_key(name, sample, [], [], "help"), value, 0.0)
    store.close()


def test_a_dead_workers_in_flight_count_is_dropped_and_its_counts_kept(tmp_path, monkeypatch):
    from portcullis.gateway.metrics import MULTIPROC_ENV, GatewayMetrics

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a worker that died (uvicorn's supervisor starts another in its place)
    _in_flight_file(tmp_path, gone.pid, 3)
    _in_flight_file(tmp_path, gone.pid, 5, kind="counter")
    _in_flight_file(tmp_path, os.getpid(), 1)  # a live worker with one request in flight
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    text = GatewayMetrics().render().decode()
    assert re.search(r"^portcullis_gateway_in_flight 1\.0$", text, re.M), text
    assert re.search(r"^portcullis_gateway_requests_total 5\.0$", text, re.M), text
    assert not (tmp_path / f"gauge_livesum_{gone.pid}.db").exists()
