"""`portcullis gateway --workers 2`: a scrape of /gateway/metrics counts every worker's requests,
whichever worker answers it, and the workers' metric files are removed when the gateway stops."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import ENGINE_TOKEN, ROOT, _free_port, base_policy, write_policy_file

REQUESTS_TOTAL = re.compile(r"^portcullis_gateway_requests_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def _requests_total(text: str) -> float:
    return sum(float(value) for value in REQUESTS_TOTAL.findall(text))


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the gateway exited"
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the gateway did not start")


def test_a_scrape_counts_the_requests_of_every_worker(gateways, tmp_path):
    folder, scratch = tmp_path / "gw", tmp_path / "tmp"
    folder.mkdir()
    scratch.mkdir()
    keys = gateways._write_keys(folder)
    (folder / "jwks.json").write_text('{"keys": []}')
    write_policy_file(folder / "policy.yaml", base_policy())
    port = _free_port()
    env = {**os.environ, "PORTCULLIS_ENGINE_TOKEN": ENGINE_TOKEN, "TMPDIR": str(scratch),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--policy", str(folder / "policy.yaml"),
                             "--engine-url", f"unix://{gateways.stub.socket}", "--port", str(port), "--workers", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        [metrics_dir] = scratch.glob("portcullis-metrics-*")
        assert oct(metrics_dir.stat().st_mode & 0o777) == "0o700"
        headers = {"authorization": f"Bearer {keys['alice']}", "connection": "close"}  # a new connection each

        def one(_: int) -> int:
            return httpx.get(url + "/v1/models", headers=headers, timeout=10).status_code

        sent = 0
        with ThreadPoolExecutor(8) as pool:
            # Until both workers have answered some (each writes its own counter file).
            while len(list(metrics_dir.glob("counter_*.db"))) < 2 and sent < 400:
                assert set(pool.map(one, range(40))) == {200}
                sent += 40
        assert len(list(metrics_dir.glob("counter_*.db"))) == 2, "the requests all went to one worker"
        admin = {"authorization": f"Bearer {keys['root']}", "connection": "close"}
        for scrape in range(1, 5):  # whichever worker answers; each scrape counts itself first
            response = httpx.get(url + "/gateway/metrics", headers=admin, timeout=10)
            assert response.status_code == 200
            assert _requests_total(response.text) == sent + scrape
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert not list(scratch.glob("portcullis-metrics-*")), "the metrics folder outlived the gateway"

