"""Rate limits per key and per tenant (requests, tokens, concurrency), in memory and in
Redis, including two gateway instances sharing Redis counters. No test waits a minute:
the memory backend is time-travelled; Redis tests only need the limit to bite."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import limits.aio.storage.memory as limits_memory
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portcullis.gateway.ratelimit as gateway_ratelimit
from portcullis.gateway.body import UNKNOWN_CONTEXT_MAX_TOKENS
from portcullis.gateway.upstream.fleet import CARDS_TTL_S

from .conftest import base_policy

BODY = {"model": "demo", "prompt": "hi", "max_tokens": 16}
# Held open by the tests while they probe the limits: 250 chunks at 30 ms is 7.5 s of slack.
STREAM = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 250,
          "stream": True}


@pytest.fixture(params=["memory", "redis"])
def storage(request: pytest.FixtureRequest) -> str:
    # The tokens-per-minute counter weights the minute before once a minute ends: a test that
    # straddles one sees the exact figures it asserts shift.
    if time.time() % 60 > 52:
        time.sleep(60.5 - time.time() % 60)
    if request.param == "memory":
        return "memory://"
    return request.getfixturevalue("redis_url")


def _policy(storage: str, tenant_limits=None, key_limits=None, prefix: str | None = None):
    policy = base_policy()
    policy["rate_limits"] = {"storage": storage, "key_prefix": prefix or f"t{uuid.uuid4().hex[:12]}"}
    policy["tenants"]["acme"]["limits"] = tenant_limits or {}
    policy["tenants"]["acme"]["key_limits"] = key_limits or {}
    return policy


async def _send(gw, who, body=BODY):
    async with gw.client() as client:
        return await gw.call(client, "POST", "/v1/completions", json=body, headers=gw.auth(who))


async def test_requests_per_key(gateways, storage):
    gw = gateways.start(_policy(storage, key_limits={"requests_per_minute": 3}))
    for remaining in (2, 1, 0):
        response, _ = await _send(gw, "alice")
        assert response.status_code == 200
        assert response.headers["x-ratelimit-limit-requests"] == "3"
        assert response.headers["x-ratelimit-remaining-requests"] == str(remaining)
    response, record = await _send(gw, "alice")
    assert response.status_code == 429 and record["reason"] == "request_rate_limit"
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-ratelimit-reset-requests"].endswith("s")
    assert response.json()["error"]["type"] == "rate_limit_error"
    for other in ("alice2", "bob", "carol"):  # other keys and other tenants are unaffected
        response, _ = await _send(gw, other)
        assert response.status_code == 200, other


async def test_requests_per_tenant(gateways, storage):
    gw = gateways.start(_policy(storage, tenant_limits={"requests_per_minute": 4}))
    for who in ("alice", "alice", "bob", "bob"):
        assert (await _send(gw, who))[0].status_code == 200
    response, record = await _send(gw, "alice2")
    assert response.status_code == 429 and "tenant" in response.json()["error"]["message"]
    assert (await _send(gw, "carol"))[0].status_code == 200  # globex is another tenant


async def test_tokens_per_key_and_per_tenant(gateways, storage):
    gw = gateways.start(_policy(storage, tenant_limits={"tokens_per_minute": 50},
                                key_limits={"tokens_per_minute": 30}))
    # Each call reserves its worst case (16 tokens) and then costs 2 prompt + 16 completion.
    response, _ = await _send(gw, "alice")
    assert response.status_code == 200 and response.headers["x-ratelimit-remaining-tokens"] == "14"
    response, record = await _send(gw, "alice")  # 18 used + 16 reserved > 30
    assert response.status_code == 429 and record["reason"] == "token_rate_limit"
    assert "tokens_per_minute (30) reached" in response.json()["error"]["message"]
    assert (await _send(gw, "bob"))[0].status_code == 200  # 36 tokens on the tenant now
    response, record = await _send(gw, "alice2")  # 36 + 16 > 50
    assert response.status_code == 429
    assert "raise tenants.acme.limits.tokens_per_minute in the policy" in response.json()["error"]["message"]
    assert (await _send(gw, "carol"))[0].status_code == 200


async def _open_stream(gw, who):
    client = gw.client()
    request = client.build_request("POST", "/v1/chat/completions", json=STREAM, headers=gw.auth(who))
    response = await client.send(request, stream=True)
    return client, response


async def _drained(gw, timeout=3.0):
    """Wait until the gateway has finished the streams the test hung up on."""
    deadline = time.monotonic() + timeout
    while gw.gateway.metrics.in_flight._value.get() > 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_concurrency_per_key_and_per_tenant(gateways, stub, storage):
    stub.chunk_delay_s = 0.03
    gw = gateways.start(_policy(storage, tenant_limits={"concurrent_requests": 2},
                                key_limits={"concurrent_requests": 1}))
    client, held = await _open_stream(gw, "alice")
    assert held.status_code == 200
    response, record = await _send(gw, "alice")
    assert response.status_code == 429 and record["reason"] == "concurrency_limit"
    client2, held2 = await _open_stream(gw, "bob")  # the tenant's second slot
    response, _ = await _send(gw, "alice2")
    assert response.status_code == 429 and "tenant" in response.json()["error"]["message"]
    assert (await _send(gw, "carol"))[0].status_code == 200
    for c, r in ((client, held), (client2, held2)):
        await r.aclose()
        await c.aclose()
    await _drained(gw)
    assert (await _send(gw, "alice"))[0].status_code == 200  # slots came back


async def test_two_gateways_share_redis_limits(gateways, stub, redis_url):
    prefix = f"shared{uuid.uuid4().hex[:8]}"
    policy = _policy(redis_url, key_limits={"requests_per_minute": 3, "concurrent_requests": 1}, prefix=prefix)
    a = gateways.start(policy, name="a")
    b = gateways.start(policy, name="b")
    b.keys = a.keys
    assert (await _send(a, "alice"))[0].status_code == 200
    assert (await _send(b, "alice"))[0].status_code == 200
    stub.chunk_delay_s = 0.03
    client, held = await _open_stream(a, "bob")
    response, record = await _send(b, "bob")
    assert response.status_code == 429 and record["reason"] == "concurrency_limit"
    await held.aclose()
    await client.aclose()
    await _drained(a)
    assert (await _send(a, "alice"))[0].status_code == 200
    response, record = await _send(b, "alice")  # the fourth across both instances
    assert response.status_code == 429 and record["reason"] == "request_rate_limit"


async def test_memory_window_resets_after_a_minute(gateways, monkeypatch):
    gw = gateways.start(_policy("memory://", key_limits={"requests_per_minute": 1}))
    assert (await _send(gw, "alice"))[0].status_code == 200
    assert (await _send(gw, "alice"))[0].status_code == 429
    later = SimpleNamespace(time=lambda: time.time() + 61)
    monkeypatch.setattr(limits_memory, "time", later)
    monkeypatch.setattr(gateway_ratelimit, "time", later)
    assert (await _send(gw, "alice"))[0].status_code == 200


async def test_many_tenants_do_not_block_each_other(gateways, storage):
    gw = gateways.start(_policy(storage, tenant_limits={"requests_per_minute": 2}))
    async with gw.client() as client:
        results = await asyncio.gather(*(
            client.post("/v1/completions", json=BODY, headers=gw.auth(who))
            for who in ("alice", "bob", "carol", "carol", "carol")
        ))
    assert [r.status_code for r in results] == [200] * 5
    records = await gw.wait_audit(5)
    assert sorted(r["request_id"] for r in records) == sorted(r.headers["x-request-id"] for r in results)


async def test_reload_can_move_limits_to_redis(gateways, redis_url):
    gw = gateways.start(_policy("memory://", key_limits={"requests_per_minute": 1}))
    assert (await _send(gw, "alice"))[0].status_code == 200
    assert (await _send(gw, "alice"))[0].status_code == 429
    gw.write_policy(_policy(redis_url, key_limits={"requests_per_minute": 1}))
    deadline = time.monotonic() + 2
    while gw.gateway.limiter.uri != redis_url:
        assert time.monotonic() < deadline, "reload not applied within 2 s"
        await asyncio.sleep(0.02)
    assert (await _send(gw, "alice"))[0].status_code == 200  # fresh counters, in Redis now
    assert (await _send(gw, "alice"))[0].status_code == 429


async def _reload_limits(gw, storage: str, **tenant_limits) -> None:
    """Write the same policy (same storage and key prefix) with new tenant limits; wait until it serves."""
    generation = gw.gateway.store.generation
    gw.write_policy(_policy(storage, tenant_limits=tenant_limits, prefix=gw.policy["rate_limits"]["key_prefix"]))
    deadline = time.monotonic() + 2
    while gw.gateway.store.generation == generation:
        assert time.monotonic() < deadline, "reload not applied within 2 s"
        await asyncio.sleep(0.02)


# Issue 29 finding 10: a counter is named by its scope, never by its limit, so an edited limit
# applies to what the window already counted (it used to start a fresh, empty window).

@pytest.mark.parametrize("new_limit,then", [(4, [(429, "0")]), (7, [(200, "1"), (200, "0"), (429, "0")])],
                         ids=["lowered", "raised"])
async def test_an_edited_requests_per_minute_keeps_the_requests_counted(gateways, storage, new_limit, then):
    gw = gateways.start(_policy(storage, tenant_limits={"requests_per_minute": 5}))
    for _ in range(5):
        assert (await _send(gw, "alice"))[0].status_code == 200
    assert (await _send(gw, "alice"))[0].status_code == 429
    await _reload_limits(gw, storage, requests_per_minute=new_limit)
    for status, remaining in then:
        response, _ = await _send(gw, "alice")
        assert (response.status_code, response.headers["x-ratelimit-remaining-requests"]) == (status, remaining)
        assert response.headers["x-ratelimit-limit-requests"] == str(new_limit)


@pytest.mark.parametrize("new_limit,then", [(30, [(429, "0")]), (60, [(200, "8"), (429, "6")])],
                         ids=["lowered", "raised"])
async def test_an_edited_tokens_per_minute_keeps_the_tokens_counted(gateways, storage, new_limit, then):
    # Each call reserves 16 tokens and uses 18: two use 36 of 40, a third (36 + 16) is refused.
    gw = gateways.start(_policy(storage, tenant_limits={"tokens_per_minute": 40}))
    for _ in range(2):
        assert (await _send(gw, "alice"))[0].status_code == 200
    assert (await _send(gw, "alice"))[0].status_code == 429
    await _reload_limits(gw, storage, tokens_per_minute=new_limit)
    for status, remaining in then:  # raised to 60: 36 + 16 fit and leave 8, then 54 used + 16 do not fit
        response, _ = await _send(gw, "alice")
        assert (response.status_code, response.headers["x-ratelimit-remaining-tokens"]) == (status, remaining)
        assert response.headers["x-ratelimit-limit-tokens"] == str(new_limit)


async def test_redis_slots_of_a_crashed_replica_lapse(redis_url, monkeypatch):
    monkeypatch.setattr(gateway_ratelimit, "SLOT_LEASE_S", 1)
    slots = gateway_ratelimit.RedisConcurrencySlots(redis_url)
    name = f"lapse-test:{uuid.uuid4().hex}"
    try:
        assert await slots.acquire(name, 1) is not None  # taken, never released: a crash
        assert await slots.acquire(name, 1) is None
        await asyncio.sleep(1.1)
        lease = await slots.acquire(name, 1)
        assert lease is not None
        await slots.release(name, lease)
        assert await slots.acquire(name, 1) is not None
    finally:
        await slots.close()


# ---- fan-out, reservations and what a 429 says (issue 13, findings 4, 5 and suite item 5) ----

async def _send_json(gw, who, body, path="/v1/completions"):
    async with gw.client() as client:
        return await gw.call(client, "POST", path, json=body, headers=gw.auth(who))


async def test_a_request_larger_than_the_token_budget_is_refused_before_the_engine(gateways, stub, storage):
    policy = _policy(storage, tenant_limits={"tokens_per_minute": 2000, "max_n": 128})
    gw = gateways.start(policy)
    response, record = await _send_json(gw, "alice", {**BODY, "n": 128})  # 128 x 16 = 2,048 tokens
    assert response.status_code == 429 and record["reason"] == "token_rate_limit"
    message = response.json()["error"]["message"]
    assert "2048 tokens" in message and "tenants.acme.limits.tokens_per_minute" in message
    assert stub.requests == []
    response, _ = await _send_json(gw, "alice", {**BODY, "n": 100})  # 1,600 reserved, 18 used
    assert response.status_code == 200
    response, _ = await _send_json(gw, "alice", BODY)
    assert response.headers["x-ratelimit-remaining-tokens"] == str(2000 - 18 - 16)  # the rest refunded


OPEN_CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens


def _uncapped(storage: str, **key_limits):
    policy = _policy(storage, key_limits=key_limits)
    del policy["defaults"]["max_tokens"]  # nor does the policy cap it
    return policy


async def test_a_chat_without_max_tokens_reserves_the_context_it_may_fill(gateways, stub, monkeypatch):
    """Issue 29: the engine lets such a reply run to the end of the context (the stub's 4,096),
    so that is what it holds, n times; it used to hold a 256-token guess and overshoot 8x."""
    gw = gateways.start(_uncapped("memory://", tokens_per_minute=10000))
    response, _ = await _send_json(gw, "alice", OPEN_CHAT, "/v1/chat/completions")
    assert response.status_code == 200 and response.headers["x-ratelimit-remaining-tokens"] == str(10000 - 4096)
    assert "max_tokens" not in stub.requests[-1]["body"]  # sent as it came: the reserve covers it
    response, record = await _send_json(gw, "alice2", {**OPEN_CHAT, "n": 3}, "/v1/chat/completions")
    assert response.status_code == 429 and record["reason"] == "token_rate_limit"
    assert "may use up to 12288 tokens" in response.json()["error"]["message"]
    # Completions default to 16 tokens, which the engine honours: that is reserved, nothing is read.
    response, _ = await _send_json(gw, "bob", {"model": "demo", "prompt": "hi"})
    assert 10000 - 16 - 8 <= int(response.headers["x-ratelimit-remaining-tokens"]) <= 10000 - 16
    assert "max_tokens" not in stub.requests[-1]["body"]
    assert [r["path"] for r in stub.requests].count("/v1/models") == 1  # read once, when first needed
    # The engine restarted with a shorter context: read again once the answer is old.
    monkeypatch.setattr(stub, "max_model_len", 2048)
    gw.gateway.fleet.replicas["engine"].cards_read_at -= CARDS_TTL_S
    response, _ = await _send_json(gw, "bob", OPEN_CHAT, "/v1/chat/completions")
    assert response.status_code == 200  # bob's earlier ~18 tokens still count (weighted, past a minute's end)
    assert 10000 - 2048 - 24 <= int(response.headers["x-ratelimit-remaining-tokens"]) <= 10000 - 2048


async def test_a_chat_without_max_tokens_is_capped_where_the_context_is_unknown(gateways, stub, monkeypatch):
    """An engine whose /v1/models does not give max_model_len: the gateway sends the
    max_tokens it reserves, so the reply cannot outgrow its reservation."""
    monkeypatch.setattr(stub, "max_model_len", None)
    gw = gateways.start(_uncapped("memory://", tokens_per_minute=1000))
    response, _ = await _send_json(gw, "alice", OPEN_CHAT, "/v1/chat/completions")
    assert response.status_code == 200 and stub.requests[-1]["body"]["max_tokens"] == UNKNOWN_CONTEXT_MAX_TOKENS
    remaining = int(response.headers["x-ratelimit-remaining-tokens"])
    assert 1000 - UNKNOWN_CONTEXT_MAX_TOKENS - 16 <= remaining < 1000 - UNKNOWN_CONTEXT_MAX_TOKENS


async def test_running_requests_hold_their_reservation(gateways, stub, storage):
    stub.chunk_delay_s = 0.03
    gw = gateways.start(_policy(storage, key_limits={"tokens_per_minute": 100}))
    stream = {**STREAM, "max_tokens": 40}  # 40 tokens + an 8-token prompt estimate, for 1.2 s
    held = []
    for _ in range(2):
        client = gw.client()
        request = client.build_request("POST", "/v1/chat/completions", json=stream, headers=gw.auth("alice"))
        held.append((client, await client.send(request, stream=True)))
        assert held[-1][1].status_code == 200
    response, record = await _send(gw, "alice")  # nothing charged yet, but 96 of 100 are held
    assert response.status_code == 429 and record["reason"] == "token_rate_limit"
    for client, held_response in held:
        await held_response.aread()
        await held_response.aclose()
        await client.aclose()


async def test_concurrency_is_counted_in_sequences(gateways, stub, storage):
    stub.chunk_delay_s = 0.03
    gw = gateways.start(_policy(storage, key_limits={"concurrent_requests": 4}))
    response, record = await _send_json(gw, "alice", {**BODY, "n": 5})
    assert response.status_code == 429 and record["reason"] == "concurrency_limit"
    message = response.json()["error"]["message"]
    assert "5 sequences" in message and "tenants.acme.key_limits.concurrent_requests" in message
    client = gw.client()
    request = client.build_request("POST", "/v1/chat/completions", json={**STREAM, "n": 4}, headers=gw.auth("alice"))
    held = await client.send(request, stream=True)
    response, record = await _send(gw, "alice")  # one more sequence than the four running
    assert response.status_code == 429 and record["reason"] == "concurrency_limit"
    assert "retry when a request in flight ends" in response.json()["error"]["message"]
    await held.aclose()
    await client.aclose()
    await _drained(gw)
    assert (await _send(gw, "alice"))[0].status_code == 200


@pytest.mark.parametrize("where,field_path", [
    ("defaults", "defaults.requests_per_minute"),
    ("tenant_keys", "tenants.acme.key_limits.requests_per_minute"),
    ("principal", "principals.bob.limits.requests_per_minute"),
    ("tenant", "tenants.acme.limits.requests_per_minute"),
])
async def test_every_429_names_the_policy_field_to_raise(gateways, where, field_path):
    policy = _policy("memory://")
    target = {"defaults": policy["defaults"], "tenant_keys": policy["tenants"]["acme"]["key_limits"],
              "principal": policy["principals"]["bob"].setdefault("limits", {}),
              "tenant": policy["tenants"]["acme"]["limits"]}[where]
    target["requests_per_minute"] = 1
    gw = gateways.start(policy)
    assert (await _send(gw, "bob"))[0].status_code == 200
    response, _ = await _send(gw, "bob")
    assert response.status_code == 429
    message = response.json()["error"]["message"]
    who = "tenant 'acme'" if where == "tenant" else "of 'bob'"
    assert who in message and f"requests_per_minute (1) reached; raise {field_path} in the policy" in message
    assert f"retry after {response.headers['retry-after']} s" in message



@pytest.mark.parametrize("refusing", ["tenant", "key"])
async def test_a_request_one_limit_refuses_spends_no_other_limit(gateways, storage, refusing):
    """A 429 from one limit takes nothing from the others (issue 30): before, a tenant's tokens
    429 still spent the key's requests per minute, so the key's next request was refused too,
    naming the key's field although the tenant's limit was the one reached."""
    tokens = {"tokens_per_minute": 30}
    gw = gateways.start(_policy(storage, tenant_limits={"requests_per_minute": 2, **(tokens if refusing == "tenant" else {})},
                                key_limits={"requests_per_minute": 2, **(tokens if refusing == "key" else {})}))
    field_path = "tenants.acme.limits" if refusing == "tenant" else "tenants.acme.key_limits"
    for _ in range(3):
        response, _ = await _send(gw, "alice", {**BODY, "max_tokens": 100})  # more than the 30 tokens a minute
        assert response.status_code == 429
        assert f"raise {field_path}.tokens_per_minute in the policy" in response.json()["error"]["message"]
    response, _ = await _send(gw, "alice")
    assert response.status_code == 200 and response.headers["x-ratelimit-remaining-requests"] == "1"


# ---- sliding windows (issue 18 item 3): no burst of twice the limit at a minute's edge ----

class FakeClock:
    """Stands in for `time` in the limiter and in limits' memory storage."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def _limited(monkeypatch, start: float, **key_limits) -> tuple[gateway_ratelimit.RateLimiter, FakeClock, tuple]:
    from portcullis.gateway.access import Access
    from portcullis.gateway.auth.principal import Principal
    from portcullis.gateway.policy.models import Limits

    clock = FakeClock(start)
    monkeypatch.setattr(limits_memory, "time", clock)
    monkeypatch.setattr(gateway_ratelimit, "time", clock)
    access = Access(tenant_models=("*",), principal_models=None, key_models=None, key_limits=Limits(**key_limits),
                    tenant_limits=Limits(), max_tokens=None, max_prompt_tokens=None, max_body_bytes=1 << 20,
                    cache_scope="tenant", tenant="acme")
    limiter = gateway_ratelimit.RateLimiter("memory://", "prop", clock=clock.time)
    return limiter, clock, (Principal("alice", "acme", key_id="k1"), access)


async def _arrive(limiter, clock, who, at: float, tokens: int = 0) -> bool:
    clock.now = at
    try:
        admission = await limiter.admit(*who, tokens=tokens)
    except gateway_ratelimit.Refusal:
        return False
    await limiter.settle(admission, tokens)
    return True


MINUTE_EDGE = 1_800_000_000.0  # a whole minute (and a UTC midnight)
ARRIVALS = st.lists(st.floats(0, 240, allow_nan=False), min_size=1, max_size=60).map(sorted)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offsets=ARRIVALS, limit=st.integers(1, 8), phase=st.floats(0, 60))
def test_no_60s_span_admits_more_requests_than_the_limit(monkeypatch, offsets, limit, phase):
    async def run() -> list[tuple[float, bool]]:
        limiter, clock, who = _limited(monkeypatch, MINUTE_EDGE, requests_per_minute=limit)
        return [(t, await _arrive(limiter, clock, who, MINUTE_EDGE + phase + t)) for t in offsets]

    seen = asyncio.run(run())
    admitted = [t for t, ok in seen if ok]
    for t in admitted:  # every 60 s span starting at an admission (the worst spans start at one)
        assert sum(t <= u <= t + 60 for u in admitted) <= limit
    for t, ok in seen:  # and nothing is refused while the last 60 s hold room
        if not ok:
            assert sum(t - 60 <= u <= t for u in admitted) == limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=st.lists(st.tuples(st.floats(0, 240, allow_nan=False), st.integers(1, 100)), min_size=1,
                         max_size=60).map(sorted), phase=st.floats(0, 60))
def test_tokens_per_minute_never_burst_to_twice_the_limit(monkeypatch, arrivals, phase):
    # The sliding-window counter weights the minute before by how much of it still overlaps the
    # last 60 s, so a span of s seconds admits at most limit x (1 + s/60) (+1 for its rounding):
    # about the limit for a burst across a minute's edge, where fixed windows let twice through.
    limit = 100

    async def run() -> list[tuple[float, int]]:
        limiter, clock, who = _limited(monkeypatch, MINUTE_EDGE, tokens_per_minute=limit)
        return [(t, cost) for t, cost in arrivals if await _arrive(limiter, clock, who, MINUTE_EDGE + phase + t, cost)]

    admitted = asyncio.run(run())
    for start, _ in admitted:
        for end, _ in admitted:
            if start <= end <= start + 60:
                span = sum(cost for u, cost in admitted if start <= u <= end)
                assert span <= limit * (1 + (end - start) / 60) + 1


async def test_a_burst_at_the_minute_edge_is_refused(monkeypatch):
    """The case the fixed windows got wrong: the limit just before a minute ends, the limit
    again just after. Now the second burst waits until the first has aged out."""
    limiter, clock, who = _limited(monkeypatch, MINUTE_EDGE, requests_per_minute=5, tokens_per_minute=50)
    assert [await _arrive(limiter, clock, who, MINUTE_EDGE + 59.5, 10) for _ in range(5)] == [True] * 5
    assert not await _arrive(limiter, clock, who, MINUTE_EDGE + 60.5, 10)
    clock.now = MINUTE_EDGE + 61
    with pytest.raises(gateway_ratelimit.Refusal) as refused:
        await limiter.admit(*who, tokens=10)
    assert refused.value.reason == "request_rate_limit"
    assert refused.value.headers["retry-after"] == "59"  # when the first of the five leaves the window
    assert await _arrive(limiter, clock, who, MINUTE_EDGE + 119.6, 10)


async def test_a_refund_goes_back_to_the_minute_that_was_charged(monkeypatch):
    limiter, clock, who = _limited(monkeypatch, MINUTE_EDGE, tokens_per_minute=50)
    clock.now = MINUTE_EDGE + 30
    admission = await limiter.admit(*who, tokens=40)  # reserved in one minute ...
    clock.now = MINUTE_EDGE + 65
    await limiter.settle(admission, 10)  # ... settled in the next, having used 10
    # The last minute now weighs 10 x 55/60: a 40-token request fits (it would not against 40).
    assert await _arrive(limiter, clock, who, MINUTE_EDGE + 65, 40)


async def test_a_request_longer_than_the_window_gets_no_refund_into_a_later_minute(monkeypatch):
    limiter, clock, who = _limited(monkeypatch, MINUTE_EDGE, tokens_per_minute=50)
    admission = await limiter.admit(*who, tokens=40)
    clock.now = MINUTE_EDGE + 200  # a long stream: its reservation has left the window already
    await limiter.settle(admission, 10)
    assert await _arrive(limiter, clock, who, MINUTE_EDGE + 200, 50)
    assert not await _arrive(limiter, clock, who, MINUTE_EDGE + 200, 1)  # no 30 tokens of credit


async def test_a_request_that_reserved_no_tokens_is_billed_what_it_used(monkeypatch):
    """A request whose worst case rounds to 0 tokens (a tiny embeddings input) still pays its
    real usage into tokens/min and the tokens budget at settle."""
    from portcullis.gateway.policy.models import Budgets

    limiter, clock, who = _limited(monkeypatch, MINUTE_EDGE, tokens_per_minute=1000,
                                   budgets=Budgets(tokens_per_day=120))
    clock.now = MINUTE_EDGE + 10
    for _ in range(2):
        await limiter.settle(await limiter.admit(*who, tokens=0), 50)
    assert await limiter.tokens_used(who[0].limit_id) == 100
    admission = await limiter.admit(*who, tokens=0)
    assert admission.headers["x-ratelimit-remaining-tokens-day"] == "20"
    await limiter.settle(admission, 50)  # 150 of the day's 120: the next request is refused
    with pytest.raises(gateway_ratelimit.Refusal) as refused:
        await limiter.admit(*who, tokens=0)
    assert refused.value.reason == "token_budget"


async def test_a_refund_on_redis_lands_in_the_minute_charged(redis_url):
    """Settling below the reservation gives the rest back on Redis too, into the counter the
    reservation went to (limits keeps the current minute under its own key there)."""
    from portcullis.gateway.access import Access
    from portcullis.gateway.auth.principal import Principal
    from portcullis.gateway.policy.models import Limits

    access = Access(tenant_models=("*",), principal_models=None, key_models=None,
                    key_limits=Limits(tokens_per_minute=50), tenant_limits=Limits(), max_tokens=None,
                    max_prompt_tokens=None, max_body_bytes=1 << 20, cache_scope="tenant", tenant="acme")
    limiter = gateway_ratelimit.RateLimiter(redis_url, f"refund{uuid.uuid4().hex[:8]}")
    who = (Principal("alice", "acme", key_id="k1"), access)
    try:
        admission = await limiter.admit(*who, tokens=40)
        with pytest.raises(gateway_ratelimit.Refusal):  # 40 held: another 40 does not fit
            await limiter.admit(*who, tokens=40)
        await limiter.settle(admission, 10)
        assert await limiter.tokens_used(who[0].limit_id) == 10
        await limiter.settle(await limiter.admit(*who, tokens=40), 40)  # now it does
        assert await limiter.tokens_used(who[0].limit_id) == 50
    finally:
        await limiter.close()
