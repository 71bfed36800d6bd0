"""Budget counters (gateway.budgets): a scope's budgets are charged all or none in one step, in
memory and on Redis alike; settles add without a check; counters keep `limits`' Redis keys."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis
from limits.storage import storage_from_string

import portcullis.gateway.budgets as budgets
from portcullis.gateway.budgets import Counter, MemoryBudgetCounters, RedisBudgetCounters


@pytest.fixture(params=["memory", "redis"])
async def counters(request: pytest.FixtureRequest):
    if request.param == "memory":
        yield MemoryBudgetCounters()
        return
    url = request.getfixturevalue("redis_url")
    yield RedisBudgetCounters(storage_from_string(f"async+{url}", implementation="redispy"))


def _keys() -> tuple[str, str]:
    run = uuid.uuid4().hex[:8]
    return f"t{run}:budget:requests:2026-12", f"t{run}:budget:tokens:2026-12-02"


async def test_one_budget_over_charges_none_of_them(counters):
    requests, tokens = _keys()
    assert await counters.charge([Counter(requests, 1, 5, 60), Counter(tokens, 30, 40, 60)]) == ([1, 30], True)
    # 30 + 30 > 40: the tokens budget refuses, so the requests budget keeps its 1 as well.
    assert await counters.charge([Counter(requests, 1, 5, 60), Counter(tokens, 30, 40, 60)]) == ([2, 60], False)
    assert await counters.charge([Counter(requests, 1, 5, 60), Counter(tokens, 10, 40, 60)]) == ([2, 40], True)


async def test_nothing_to_add_is_refused_once_a_budget_is_spent(counters):
    requests, tokens = _keys()
    assert await counters.charge([Counter(tokens, 0, 40, 60)]) == ([0], True)  # billed at settle
    await counters.adjust([(tokens, 40)], 60)
    assert await counters.charge([Counter(requests, 1, 5, 60), Counter(tokens, 0, 40, 60)]) == ([1, 40], False)


async def test_settles_add_without_a_check(counters):
    requests, tokens = _keys()
    await counters.charge([Counter(requests, 1, 5, 60), Counter(tokens, 16, 40, 60)])
    await counters.adjust([(tokens, 30), (requests, -1)], 60)  # overran its reservation; one never ran
    assert await counters.charge([Counter(requests, 1, 5, 60), Counter(tokens, 0, 40, 60)]) == ([1, 46], False)


async def test_a_counter_is_kept_for_its_expiry_then_starts_again(monkeypatch):
    clock = [1_800_000_000.0]
    monkeypatch.setattr(budgets, "time", SimpleNamespace(time=lambda: clock[0]))
    counters, (_, tokens) = MemoryBudgetCounters(), _keys()
    await counters.charge([Counter(tokens, 30, 40, 100)])
    clock[0] += 99  # a settle later in the period does not move the expiry
    await counters.adjust([(tokens, 5)], 3600)
    assert await counters.charge([Counter(tokens, 10, 40, 100)]) == ([45], False)
    clock[0] += 1
    assert await counters.charge([Counter(tokens, 10, 40, 100)]) == ([10], True)


async def test_redis_counters_keep_limits_keys_and_expiry(redis_url):
    counters = RedisBudgetCounters(storage_from_string(f"async+{redis_url}", implementation="redispy"))
    requests, tokens = _keys()
    await counters.charge([Counter(requests, 1, 5, 1000), Counter(tokens, 16, 40, 2000)])
    client = aioredis.from_url(redis_url)
    try:
        assert int(await client.get(f"LIMITS:{tokens}")) == 16  # where limits' incr put it before
        assert 1900 < await client.ttl(f"LIMITS:{tokens}") <= 2000
        assert 900 < await client.ttl(f"LIMITS:{requests}") <= 1000
    finally:
        await client.aclose()
