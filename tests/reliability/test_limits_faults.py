"""Rate limits when their Redis storage fails: unreachable from the start, or stopped mid-run
with requests in flight. The policy's `rate_limits.on_storage_error` decides: refuse (503, the
default) or allow (served without limits); either way the audit line says so, and nothing
answers 500 or shows a stack trace."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.gateway.conftest import base_policy

BODY = {"model": "demo", "prompt": "hi", "max_tokens": 8}
LIMITS = {"requests_per_minute": 100, "tokens_per_minute": 10_000, "concurrent_requests": 4}


def _closed_port() -> int:
    with socket.socket() as sock:  # bound then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _policy(storage: str, on_error: str | None = None) -> dict:
    policy = base_policy()
    policy["rate_limits"] = {"storage": storage, "key_prefix": f"f{uuid.uuid4().hex[:12]}"}
    if on_error:
        policy["rate_limits"]["on_storage_error"] = on_error
    policy["tenants"]["acme"]["key_limits"] = LIMITS
    return policy


async def _send(gw, body=BODY):
    async with gw.client() as client:
        return await gw.call(client, "POST", "/v1/completions", json=body, headers=gw.auth())


def _assert_clean(response) -> None:
    assert "Traceback" not in response.text and "redis" not in response.text.lower()


async def test_unreachable_redis_refuses_by_default(gateways, stub):
    gw = gateways.start(_policy(f"redis://127.0.0.1:{_closed_port()}/0"))
    started = time.monotonic()
    response, record = await _send(gw)
    assert time.monotonic() - started < 5
    assert response.status_code == 503 and response.headers["retry-after"]
    error = response.json()["error"]
    assert error["code"] == "rate_limits_unavailable" and "on_storage_error" in error["message"]
    assert record["reason"] == "rate_limits_unavailable" and record["decision"] == "denied"
    assert stub.requests == []
    _assert_clean(response)


async def test_unreachable_redis_serves_unlimited_when_the_policy_allows(gateways, stub):
    gw = gateways.start(_policy(f"redis://127.0.0.1:{_closed_port()}/0", on_error="allow"))
    for _ in range(2):
        response, record = await _send(gw)
        assert response.status_code == 200
        assert record["decision"] == "allowed" and record["reason"] == "rate_limits_unavailable"
        assert "x-ratelimit-remaining-requests" not in response.headers  # nothing was counted


class PrivateRedis:
    """A redis-server of this test's own, so stopping it touches no one else's."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail("redis-server is not installed")
            pytest.skip("redis-server is not installed")
        self.binary, self.folder, self.port = binary, folder, _closed_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "private redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def private_redis(tmp_path):
    redis = PrivateRedis(tmp_path)
    redis.start()
    yield redis
    redis.stop()


async def test_redis_stopped_mid_run_fails_closed_then_recovers(gateways, stub, private_redis):
    stub.chunk_delay_s = 0.05
    gw = gateways.start(_policy(private_redis.url))
    assert (await _send(gw))[0].status_code == 200
    async with gw.client() as client:
        stream = {**BODY, "max_tokens": 20, "stream": True}  # 1 s: Redis dies while it runs
        async with client.stream("POST", "/v1/completions", json=stream, headers=gw.auth()) as held:
            assert held.status_code == 200
            private_redis.stop()
            text = (await held.aread()).decode()
    assert text.endswith("data: [DONE]\n\n")  # the running request finished untouched
    records = await gw.wait_audit(2)
    assert records[-1]["status"] == 200  # and was audited, though its settlement failed
    response, record = await _send(gw)
    assert response.status_code == 503 and record["reason"] == "rate_limits_unavailable"
    _assert_clean(response)
    private_redis.start()  # same port: the gateway reconnects by itself
    deadline = time.monotonic() + 5
    while (response := (await _send(gw))[0]).status_code != 200:
        assert response.status_code == 503 and time.monotonic() < deadline
    assert response.headers["x-ratelimit-remaining-requests"]


async def test_redis_stopped_mid_run_serves_unlimited_when_allowed(gateways, stub, private_redis):
    gw = gateways.start(_policy(private_redis.url, on_error="allow"))
    assert (await _send(gw))[1]["reason"] == "ok"
    private_redis.stop()
    response, record = await _send(gw)
    assert response.status_code == 200 and record["reason"] == "rate_limits_unavailable"


@pytest.mark.parametrize("on_error,status", [(None, 503), ("allow", 200)])
async def test_budgets_alone_follow_the_storage_policy(gateways, stub, on_error, status):
    """A policy with budgets and no per-minute limits still needs its storage: unreachable Redis
    refuses (or, when allowed, serves uncounted) exactly as for the minute limits."""
    policy = _policy(f"redis://127.0.0.1:{_closed_port()}/0", on_error)
    policy["tenants"]["acme"]["key_limits"] = {"budgets": {"tokens_per_day": 1000, "requests_per_month": 50}}
    gw = gateways.start(policy)
    response, record = await _send(gw)
    assert response.status_code == status and record["reason"] == "rate_limits_unavailable"
    assert "x-ratelimit-remaining-tokens-day" not in response.headers
    assert len(stub.requests) == (status == 200)
    _assert_clean(response)
