"""Token and request budgets per UTC day and month (issue 18 item 3): reserved at admission,
settled to real usage, refused with 429 until the period ends, reported in headers, shared
over Redis by two gateway instances, and back in full at the boundary (the clock is injected:
no test waits for midnight)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import httpx
import pytest
import yaml

from portcullis.cli import main

from .conftest import (
    ENGINE_TOKEN,
    ROOT,
    _free_port,
    base_policy,
    wait_for_workers,
    write_policy_file,
)

BODY = {"model": "demo", "prompt": "hi", "max_tokens": 16}  # reserves 16, uses 2 + 16 = 18
NEW_YEAR = datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp()  # a day's and a month's end


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def storage(request: pytest.FixtureRequest) -> str:
    return "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")


def _policy(storage: str, tenant: dict | None = None, key: dict | None = None, prefix: str | None = None) -> dict:
    policy = base_policy()
    policy["rate_limits"] = {"storage": storage, "key_prefix": prefix or f"b{uuid.uuid4().hex[:12]}"}
    policy["tenants"]["acme"]["limits"] = {"budgets": tenant or {}}
    policy["tenants"]["acme"]["key_limits"] = {"budgets": key or {}}
    return policy


def _start(gateways, policy: dict, now: float, name: str = "gw"):
    gw = gateways.start(policy, name=name)
    clock = gw.gateway.limiter.clock = Clock(now)
    return gw, clock


async def _send(gw, who: str, body: dict = BODY):
    async with gw.client() as client:
        return await gw.call(client, "POST", "/v1/completions", json=body, headers=gw.auth(who))


async def _rate_limited(gw, reason: str) -> float:
    """portcullis_gateway_rate_limited for `reason` and tenant acme, as a scrape reports it."""
    async with gw.client() as client:
        response, _ = await gw.call(client, "GET", "/gateway/metrics", headers=gw.auth("root"))
    found = [line for line in response.text.splitlines() if line.startswith("portcullis_gateway_rate_limited_total{")
             and f'reason="{reason}"' in line and 'tenant="acme"' in line]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


async def test_a_key_token_budget_is_used_up_then_resets_at_midnight_utc(gateways, stub, storage):
    gw, clock = _start(gateways, _policy(storage, key={"tokens_per_day": 40}), NEW_YEAR - 100)
    response, _ = await _send(gw, "alice")
    assert response.status_code == 200
    assert response.headers["x-ratelimit-limit-tokens-day"] == "40"
    assert response.headers["x-ratelimit-remaining-tokens-day"] == "24"  # 16 reserved
    assert response.headers["x-ratelimit-reset-tokens-day"] == "100s"
    response, _ = await _send(gw, "alice")  # 18 settled + 16 reserved
    assert response.headers["x-ratelimit-remaining-tokens-day"] == "6"
    sent = len(stub.requests)
    response, record = await _send(gw, "alice")  # 36 used + 16 > 40
    assert response.status_code == 429 and len(stub.requests) == sent
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "token_budget"
    assert error["message"].startswith("key '") and error["message"].endswith(
        "budgets.tokens_per_day (40) is used up for this UTC day; it resets at 2027-01-01T00:00:00Z (in 1m 40s). "
        "Raise tenants.acme.key_limits.budgets.tokens_per_day in the policy, or retry then.")
    assert response.headers["retry-after"] == "100"
    assert response.headers["x-ratelimit-remaining-tokens-day"] == "4"  # the refused request took nothing
    assert record["decision"] == "denied" and record["reason"] == "token_budget" and record["status"] == 429
    assert await _rate_limited(gw, "token_budget") == 1.0  # operators see budget refusals in the metrics
    assert (await _send(gw, "bob"))[0].status_code == 200  # each key has its own budget
    clock.now = NEW_YEAR + 1
    response, _ = await _send(gw, "alice")
    assert response.status_code == 200 and response.headers["x-ratelimit-remaining-tokens-day"] == "24"
    assert response.headers["x-ratelimit-reset-tokens-day"] == f"{24 * 3600 - 1}s"


async def test_a_tenant_request_budget_per_month(gateways, storage):
    gw, clock = _start(gateways, _policy(storage, tenant={"requests_per_month": 3}), NEW_YEAR - 7200)
    for who, remaining in (("alice", 2), ("bob", 1), ("alice2", 0)):
        response, _ = await _send(gw, who)
        assert response.status_code == 200 and response.headers["x-ratelimit-remaining-requests-month"] == str(remaining)
    response, record = await _send(gw, "bob")
    assert response.status_code == 429 and record["reason"] == "request_budget"
    message = response.json()["error"]["message"]
    assert message.startswith("tenant 'acme' budgets.requests_per_month (3) is used up for this UTC month; "
                              "it resets at 2027-01-01T00:00:00Z (in 2h)")
    assert "raise tenants.acme.limits.budgets.requests_per_month" in message.lower()
    assert response.headers["retry-after"] == "7200"
    assert (await _send(gw, "carol"))[0].status_code == 200  # another tenant
    response, _ = await _send(gw, "bob")  # still refused, and refusals do not count
    assert response.headers["x-ratelimit-remaining-requests-month"] == "0"
    assert await _rate_limited(gw, "request_budget") == 2.0
    clock.now = NEW_YEAR
    response, _ = await _send(gw, "bob")
    assert response.status_code == 200 and response.headers["x-ratelimit-remaining-requests-month"] == "2"


async def test_a_request_refused_by_one_budget_costs_nothing_of_the_others(gateways, storage):
    new_years_eve = datetime(2026, 12, 31, tzinfo=timezone.utc).timestamp()
    policy = _policy(storage, tenant={"tokens_per_day": 40}, key={"requests_per_month": 2})
    gw, clock = _start(gateways, policy, new_years_eve - 60)
    assert (await _send(gw, "alice"))[0].status_code == 200  # alice: 1 of 2 this month
    assert (await _send(gw, "bob"))[0].status_code == 200  # the tenant: 36 of 40 tokens today
    response, record = await _send(gw, "alice")  # passes alice's budget, then the tenant's refuses
    assert response.status_code == 429 and record["reason"] == "token_budget"
    clock.now = new_years_eve + 1  # a new day, the same month
    response, _ = await _send(gw, "alice")
    assert response.status_code == 200  # the refused request did not count against alice's month
    assert response.headers["x-ratelimit-remaining-requests-month"] == "0"
    assert (await _send(gw, "alice"))[0].status_code == 429


async def test_a_request_larger_than_the_whole_budget_is_refused_for_good(gateways, stub):
    gw, _ = _start(gateways, _policy("memory://", key={"tokens_per_day": 10}), NEW_YEAR - 100)
    response, record = await _send(gw, "alice")
    assert response.status_code == 429 and record["reason"] == "token_budget"
    message = response.json()["error"]["message"]
    assert "may use up to 16 tokens, more than key" in message and "budgets.tokens_per_day (10)" in message
    assert "lower max_tokens" in message and "retry-after" not in response.headers  # waiting would not help
    assert stub.requests == []


async def test_budgets_hold_across_two_gateways_sharing_redis(gateways, stub, redis_url):
    """Two gateway instances (each its own app, limiter and Redis connections, in one test
    process) share one Redis: the budget is one budget, and both see it reset."""
    policy = _policy(redis_url, key={"requests_per_day": 3, "tokens_per_day": 1000},
                     prefix=f"two{uuid.uuid4().hex[:8]}")
    a, clock_a = _start(gateways, policy, NEW_YEAR - 60, name="a")
    b, clock_b = _start(gateways, policy, NEW_YEAR - 60, name="b")
    b.keys = a.keys
    statuses = [(await _send(gw, "alice"))[0] for gw in (a, b, a)]
    assert [r.status_code for r in statuses] == [200] * 3
    assert statuses[-1].headers["x-ratelimit-remaining-tokens-day"] == str(1000 - 2 * 18 - 16)
    response, record = await _send(b, "alice")  # the fourth across both
    assert response.status_code == 429 and record["reason"] == "request_budget"
    assert (await _send(a, "alice"))[0].status_code == 429
    clock_a.now = clock_b.now = NEW_YEAR + 5
    assert (await _send(b, "alice"))[0].status_code == 200
    response, _ = await _send(a, "alice")
    assert response.status_code == 200 and response.headers["x-ratelimit-remaining-requests-day"] == "1"


def test_a_budget_holds_across_two_worker_processes_on_redis(gateways, redis_url, tmp_path):
    """`portcullis gateway --workers 2`: two processes, one Redis, one budget. (The reset at the
    period's end is shown by the in-process test above, whose clock can be moved.)"""
    folder, scratch = tmp_path / "gw", tmp_path / "tmp"
    folder.mkdir()
    scratch.mkdir()
    keys = gateways._write_keys(folder)
    (folder / "jwks.json").write_text('{"keys": []}')
    write_policy_file(folder / "policy.yaml", _policy(redis_url, key={"requests_per_day": 20}))
    port = _free_port()
    env = {**os.environ, "PORTCULLIS_ENGINE_TOKEN": ENGINE_TOKEN, "TMPDIR": str(scratch), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "portcullis.cli", "gateway", "--policy", str(folder / "policy.yaml"),
                             "--engine-url", f"unix://{gateways.stub.socket}", "--port", str(port), "--workers", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {keys['alice']}", "connection": "close"}  # a new connection each

    def one(_: int) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=BODY, headers=headers, timeout=20)

    try:
        wait_for_workers(folder / "audit.log", proc, 2)  # else the first may take every request
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(one, range(60)))
        [metrics] = scratch.glob("portcullis-metrics-*")
        assert len(list(metrics.glob("counter_*.db"))) == 2, "the requests all went to one worker"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 20 and statuses.count(429) == 40  # each worker alone would admit 20
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "request_budget"


@pytest.mark.parametrize("budgets,expected", [
    ({"tokens_per_day": 0}, "budgets.tokens_per_day: Input should be greater than or equal to 1"),
    ({"tokens_per_week": 10}, "budgets.tokens_per_week"),
    ({"tokens_per_day": 500, "tokens_per_month": 100},
     "tokens_per_day (500) is larger than tokens_per_month (100); a day's budget must fit in the month's"),
])
def test_policy_check_refuses_a_bad_budget(tmp_path, capsys, budgets, expected):
    policy = base_policy()
    policy["tenants"]["acme"]["limits"] = {"budgets": budgets}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    assert main(["policy", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"INVALID {path}:") and expected in out, out


def test_budgets_in_memory_are_warned_about_in_policy_check_and_on_a_reload(tmp_path, capsys):
    """memory:// budgets start from zero at every restart and per worker: say so, naming them."""
    from structlog.testing import capture_logs

    from portcullis.gateway.policy.store import PolicyStore

    policy, path = base_policy(), tmp_path / "policy.yaml"
    policy["rate_limits"] = {"storage": "memory://"}
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    store = PolicyStore(path)
    policy["tenants"]["acme"]["key_limits"] = {"budgets": {"tokens_per_month": 1000}}
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    with capture_logs() as logs:
        assert store.reload()
    [warned] = [line for line in logs if line["event"] == "budgets_in_memory"]
    assert "tenants.acme.key_limits.budgets" in warned["warning"]
    assert "set rate_limits.storage to a redis:// URL" in warned["warning"]
    assert main(["policy", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: budgets (tenants.acme.key_limits.budgets) are counted in each gateway process's memory" in out
    policy["rate_limits"] = {"storage": "redis://127.0.0.1:6379"}
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    assert main(["policy", "check", str(path)]) == 0
    assert "budgets (" not in capsys.readouterr().out


@pytest.mark.parametrize("where,expected", [
    ("tenant", "tenants.acme.key_limits.budgets.tokens_per_day (500) is larger than the tokens_per_month (100) "
               "of tenants.acme.limits"),
    ("defaults", "tenants.acme.key_limits.budgets.tokens_per_day (500) is larger than the tokens_per_month (100) "
                 "that applies to it"),
])
def test_policy_check_refuses_a_key_day_budget_above_an_inherited_month(tmp_path, capsys, where, expected):
    """Each key's day budget could never be spent under a smaller month budget set elsewhere."""
    policy = base_policy()
    policy["tenants"]["acme"]["key_limits"] = {"budgets": {"tokens_per_day": 500}}
    month = {"budgets": {"tokens_per_month": 100}}
    if where == "tenant":
        policy["tenants"]["acme"]["limits"] = month
    else:
        policy["defaults"] = month
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    assert main(["policy", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"INVALID {path}") and expected in out, out
