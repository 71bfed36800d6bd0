"""Per-key and per-tenant limits: requests/min, tokens/min and concurrent requests.

Counters live in `limits`' async storage (memory by default, Redis when gateway workers or
replicas must share them). Fixed one-minute windows on the clock: one INCR per check, exact token
accounting (a hit always records its cost, even past the cap), and cheap enough to keep the
gateway's per-request budget.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field

from limits.aio.storage import MemoryStorage, Storage
from limits.storage import storage_from_string

from gateway.access import Access
from gateway.auth.principal import Principal
from gateway.errors import Refusal

SLOT_LEASE_S = 900  # longer than any request; a crashed replica's slots lapse after this
WINDOW_S = 60


def _window() -> tuple[int, float]:
    """The current minute and when it ends. Windows follow the clock rather than each
    counter's first hit, so the reset time is known without asking the storage again
    (one round trip per check instead of two when counters live in Redis)."""
    index = int(time.time() // WINDOW_S)
    return index, float((index + 1) * WINDOW_S)


@dataclass
class Admission:
    """What a request took from the limits; settled exactly once when it ends."""

    principal: Principal
    access: Access
    slots: list[tuple[str, str]] = field(default_factory=list)  # (counter, lease)
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False
    # The limiter that admitted it: a reload may swap the gateway's limiter mid-request.
    limiter: RateLimiter | None = None


class ConcurrencySlots:
    """In-process slot counters (the memory backend)."""

    def __init__(self) -> None:
        self._held: defaultdict[str, int] = defaultdict(int)

    async def acquire(self, name: str, limit: int) -> str | None:
        if self._held[name] >= limit:
            return None
        self._held[name] += 1
        return ""

    async def release(self, name: str, lease: str) -> None:
        self._held[name] -= 1
        if self._held[name] <= 0:
            del self._held[name]

    async def close(self) -> None:
        return None


class RedisConcurrencySlots:
    """Slots shared through Redis as leases: one sorted-set member per request, scored by
    when it lapses. A replica that dies mid-request leaks only leases that run out on their
    own; a plain shared counter would stay inflated for as long as traffic kept it alive."""

    def __init__(self, uri: str) -> None:
        import redis.asyncio as aioredis  # optional until a policy names Redis

        self._redis = aioredis.from_url(uri)

    async def acquire(self, name: str, limit: int) -> str | None:
        lease, now = secrets.token_hex(8), time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(name, "-inf", now).zadd(name, {lease: now + SLOT_LEASE_S})
            _, _, held, _ = await pipe.zcard(name).expire(name, SLOT_LEASE_S).execute()
        if held > limit:  # added first, checked after: two replicas can never both squeeze in
            await self._redis.zrem(name, lease)
            return None
        return lease

    async def release(self, name: str, lease: str) -> None:
        await self._redis.zrem(name, lease)

    async def close(self) -> None:
        await self._redis.aclose()


def _storage(uri: str) -> Storage:
    if uri.startswith("memory://"):
        return MemoryStorage()
    return storage_from_string(f"async+{uri}", implementation="redispy")


class RateLimiter:
    def __init__(self, uri: str, prefix: str) -> None:
        self.uri = uri
        self.prefix = prefix
        self.storage = _storage(uri)
        self.slots = ConcurrencySlots() if uri.startswith("memory://") else RedisConcurrencySlots(uri)

    async def close(self) -> None:
        await self.slots.close()

    def _key(self, kind: str, scope: str) -> str:
        return f"{self.prefix}:{kind}:{scope}"

    def _scopes(self, principal: Principal, access: Access) -> list[tuple[str, object]]:
        return [(principal.limit_id, access.key_limits), (f"tenant:{principal.tenant}", access.tenant_limits)]

    async def admit(self, principal: Principal, access: Access) -> Admission:
        """Take a slot and a request from each scope, or refuse with 429 (taking nothing)."""
        admission = Admission(principal, access, limiter=self)
        try:
            for scope, limits in self._scopes(principal, access):
                await self._take_slot(admission, scope, limits.concurrent_requests)
                await self._count_request(admission, scope, limits.requests_per_minute)
                await self._check_tokens(admission, scope, limits.tokens_per_minute)
        except Refusal as refusal:
            await self.release(admission)
            refusal.headers = {**admission.headers, **refusal.headers}
            raise
        return admission

    async def _take_slot(self, admission: Admission, scope: str, limit: int | None) -> None:
        if limit is None:
            return
        name = self._key("conc", scope)
        lease = await self.slots.acquire(name, limit)
        if lease is None:
            raise _over("concurrency_limit", "Too many concurrent requests.", scope, 1)
        admission.slots.append((name, lease))

    async def _count_request(self, admission: Admission, scope: str, limit: int | None) -> None:
        if limit is None:
            return
        window, reset = _window()
        used = await self.storage.incr(self._key("req", f"{scope}:{window}"), WINDOW_S + 5)
        _set_headers(admission.headers, "requests", limit, limit - used, reset)
        if used > limit:
            raise _over("request_rate_limit", "Request rate limit exceeded.", scope, reset - time.time())

    async def _check_tokens(self, admission: Admission, scope: str, limit: int | None) -> None:
        if limit is None:
            return
        window, reset = _window()
        used = await self.storage.get(self._key("tok", f"{scope}:{window}"))
        _set_headers(admission.headers, "tokens", limit, limit - used, reset)
        if used >= limit:
            raise _over("token_rate_limit", "Token rate limit exceeded.", scope, reset - time.time())

    async def settle(self, admission: Admission, tokens: int) -> None:
        """Charge the tokens the engine reported and give the slots back."""
        if admission.settled:
            return
        try:
            if tokens > 0:
                window, _ = _window()
                for scope, limits in self._scopes(admission.principal, admission.access):
                    if limits.tokens_per_minute is not None:
                        key = self._key("tok", f"{scope}:{window}")
                        await self.storage.incr(key, WINDOW_S + 5, amount=tokens)
        finally:
            await self.release(admission)

    async def release(self, admission: Admission) -> None:
        admission.settled = True
        slots, admission.slots = admission.slots, []
        for name, lease in slots:
            await self.slots.release(name, lease)


def _set_headers(headers: dict[str, str], kind: str, limit: int, remaining: int, reset: float) -> None:
    """OpenAI's x-ratelimit-* headers; with two scopes the tighter one is reported."""
    remaining = max(0, remaining)
    current = headers.get(f"x-ratelimit-remaining-{kind}")
    if current is not None and int(current) <= remaining:
        return
    headers[f"x-ratelimit-limit-{kind}"] = str(limit)
    headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
    headers[f"x-ratelimit-reset-{kind}"] = f"{max(0, math.ceil(reset - time.time()))}s"


def _over(reason: str, message: str, scope: str, wait_s: float) -> Refusal:
    who = scope.split(":", 1)[0] if scope in ("client",) or scope.startswith("tenant:") else "key"
    retry = str(max(1, math.ceil(wait_s)))
    return Refusal(429, f"{message} ({who} limit)", reason, headers={"retry-after": retry})


class FailedAuthLimiter:
    """Failed authentications, counted per (client address, credential) and per address.

    Consulted only once a credential has failed, so a valid credential is never refused by it:
    behind a reverse proxy every client shares the proxy's address, and one client's bad or
    revoked token must not lock the others out. A client that keeps presenting the same bad
    credential, or an address that presents many different ones (ADDRESS_FACTOR times the
    limit: a guessing run), gets 429 instead of 401 until its minute ends. Always in process
    memory: the keys themselves (256 random bits) are not guessable however many replicas an
    attacker hits; this only slows a noisy client and marks it in the audit log.
    """

    ADDRESS_FACTOR = 10

    def __init__(self) -> None:
        self.storage = MemoryStorage()

    async def failed(self, address: str, credential: str, limit: int) -> None:
        """Count one failure; raise 429 when this credential or this address is over its limit."""
        counters = ((f"authfail:{address}|{credential}", limit), (f"authfail:{address}", limit * self.ADDRESS_FACTOR))
        counts = [await self.storage.incr(key, WINDOW_S) for key, _ in counters]
        for (key, cap), count in zip(counters, counts, strict=True):
            if count > cap:
                wait = max(1, math.ceil(await self.storage.get_expiry(key) - time.time()))
                raise Refusal(429, "Too many failed authentication attempts from this address; check the API key "
                              f"or token, then retry after {wait} s.", "auth_rate_limit",
                              headers={"retry-after": str(wait)})
