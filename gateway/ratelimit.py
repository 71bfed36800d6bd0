"""Per-key and per-tenant limits: requests/min, tokens/min and concurrent sequences.

Counters live in `limits`' async storage (memory by default, Redis when gateway workers or
replicas must share them). Fixed one-minute windows on the clock: one INCR per check. A request
reserves its worst-case token cost at admission (so one request cannot overshoot the budget by
n x prompts x max_tokens) and settles to what it really used at the end; concurrency is counted
in sequences (n x prompts), the engine's unit of work. When the storage fails, the policy's
`rate_limits.on_storage_error` says whether requests are refused (503) or served unlimited.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field

import structlog
from limits.aio.storage import MemoryStorage, Storage
from limits.errors import StorageError
from limits.storage import storage_from_string

from gateway.access import Access
from gateway.auth.principal import Principal
from gateway.errors import Refusal

log = structlog.get_logger("gateway.ratelimit")

SLOT_LEASE_S = 900  # longer than any request; a crashed replica's slots lapse after this
WINDOW_S = 60
STORAGE_DOWN = "rate_limits_unavailable"


def _storage_errors() -> tuple[type[Exception], ...]:
    """What a failing storage raises; anything else is a bug and must not read as an outage."""
    try:
        from redis.exceptions import RedisError  # optional until a policy names Redis
    except ImportError:
        return (OSError, StorageError)
    return (OSError, StorageError, RedisError)


STORAGE_ERRORS = _storage_errors()


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
    slots: list[tuple[str, str, int]] = field(default_factory=list)  # (counter, lease, sequences)
    reservations: list[tuple[str, int, int]] = field(default_factory=list)  # (scope, window, tokens)
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False
    unlimited: bool = False  # the storage failed and the policy says serve anyway
    # The limiter that admitted it: a reload may swap the gateway's limiter mid-request.
    limiter: RateLimiter | None = None


class ConcurrencySlots:
    """In-process slot counters (the memory backend)."""

    def __init__(self) -> None:
        self._held: defaultdict[str, int] = defaultdict(int)

    async def acquire(self, name: str, limit: int, count: int = 1) -> str | None:
        if self._held[name] + count > limit:
            return None
        self._held[name] += count
        return ""

    async def release(self, name: str, lease: str, count: int = 1) -> None:
        self._held[name] -= count
        if self._held[name] <= 0:
            del self._held[name]

    async def close(self) -> None:
        return None


class RedisConcurrencySlots:
    """Slots shared through Redis as leases: one sorted-set member per sequence, scored by
    when it lapses. A replica that dies mid-request leaks only leases that run out on their
    own; a plain shared counter would stay inflated for as long as traffic kept it alive."""

    def __init__(self, uri: str) -> None:
        import redis.asyncio as aioredis  # optional until a policy names Redis

        self._redis = aioredis.from_url(uri)

    async def acquire(self, name: str, limit: int, count: int = 1) -> str | None:
        lease, now = secrets.token_hex(8), time.time()
        members = {f"{lease}:{i}": now + SLOT_LEASE_S for i in range(count)}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(name, "-inf", now).zadd(name, members)
            _, _, held, _ = await pipe.zcard(name).expire(name, SLOT_LEASE_S).execute()
        if held > limit:  # added first, checked after: two replicas can never both squeeze in
            await self._redis.zrem(name, *members)
            return None
        return lease

    async def release(self, name: str, lease: str, count: int = 1) -> None:
        await self._redis.zrem(name, *(f"{lease}:{i}" for i in range(count)))

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

    def _scopes(self, principal: Principal, access: Access) -> list[tuple[str, str, object]]:
        """(counter scope, "key" or "tenant", its limits)."""
        return [(principal.limit_id, "key", access.key_limits),
                (f"tenant:{principal.tenant}", "tenant", access.tenant_limits)]

    async def admit(self, principal: Principal, access: Access, tokens: int = 0, sequences: int = 1,
                    on_storage_error: str = "refuse") -> Admission:
        """Take slots for `sequences`, a request and a reservation of `tokens` from each scope,
        or refuse with 429 (taking nothing)."""
        admission = Admission(principal, access, limiter=self)
        try:
            for scope, kind, limits in self._scopes(principal, access):
                over = _Over(principal, access, kind, admission.headers)
                await self._take_slots(admission, scope, over, limits.concurrent_requests, sequences)
                await self._count_request(admission, scope, over, limits.requests_per_minute)
                await self._reserve_tokens(admission, scope, over, limits.tokens_per_minute, tokens)
        except Refusal as refusal:
            await self.release(admission)
            refusal.headers = {**admission.headers, **refusal.headers}
            raise
        except STORAGE_ERRORS as exc:
            await self.release(admission)
            return self._storage_failed(admission, exc, on_storage_error)
        return admission

    def _storage_failed(self, admission: Admission, exc: Exception, on_error: str) -> Admission:
        log.warning("rate_limit_storage_failed", storage=_redacted(self.uri), error=type(exc).__name__,
                    on_storage_error=on_error)
        if on_error != "allow":
            raise Refusal(503, "Rate limits cannot be checked: their storage is unreachable, and the policy "
                          "refuses requests until it is back (rate_limits.on_storage_error: refuse). Retry "
                          "shortly.", STORAGE_DOWN, headers={"retry-after": "5"})
        admission.headers, admission.unlimited = {}, True
        return admission

    async def _take_slots(self, admission: Admission, scope: str, over: _Over, limit: int | None,
                          sequences: int) -> None:
        if limit is None:
            return
        if sequences > limit:
            raise over.never("concurrent_requests", limit,
                             f"runs {sequences} sequences at once (n x prompts, or embedding inputs)",
                             "lower n or the number of prompts or inputs")
        name = self._key("conc", scope)
        lease = await self.slots.acquire(name, limit, sequences)
        if lease is None:
            raise over.reached("concurrent_requests", limit, "concurrency_limit", 1,
                               "retry when a request in flight ends")
        admission.slots.append((name, lease, sequences))

    async def _count_request(self, admission: Admission, scope: str, over: _Over, limit: int | None) -> None:
        if limit is None:
            return
        window, reset = _window()
        used = await self.storage.incr(self._key("req", f"{scope}:{window}"), WINDOW_S + 5)
        _set_headers(admission.headers, "requests", limit, limit - used, reset)
        if used > limit:
            raise over.reached("requests_per_minute", limit, "request_rate_limit", reset - time.time())

    async def _reserve_tokens(self, admission: Admission, scope: str, over: _Over, limit: int | None,
                              tokens: int) -> None:
        if limit is None:
            return
        if tokens > limit:
            raise over.never("tokens_per_minute", limit, f"may use up to {tokens} tokens",
                             "lower max_tokens or n, or send a shorter prompt or input")
        window, reset = _window()
        key = self._key("tok", f"{scope}:{window}")
        # Added first, checked after (as for slots): concurrent requests cannot both fit in the rest.
        used = await self.storage.incr(key, WINDOW_S + 5, amount=tokens) if tokens else await self.storage.get(key)
        admission.reservations.append((scope, window, tokens))
        _set_headers(admission.headers, "tokens", limit, limit - used, reset)
        if used > limit if tokens else used >= limit:
            raise over.reached("tokens_per_minute", limit, "token_rate_limit", reset - time.time())

    async def settle(self, admission: Admission, tokens: int) -> None:
        """Charge what the request really used (its reservation adjusted to it) and give the
        slots back."""
        await self._end(admission, tokens)

    async def release(self, admission: Admission) -> None:
        """Give everything back: the request never reached the engine."""
        await self._end(admission, 0)

    async def _end(self, admission: Admission, tokens: int) -> None:
        if admission.settled:
            return
        admission.settled = True
        reservations, admission.reservations = admission.reservations, []
        slots, admission.slots = admission.slots, []
        try:
            for scope, window, held in reservations:
                await self._adjust(scope, window, tokens - held)
            for name, lease, count in slots:
                await self.slots.release(name, lease, count)
        except STORAGE_ERRORS as exc:  # Redis slots lapse on their own, counters with their minute
            log.warning("rate_limit_storage_failed", storage=_redacted(self.uri), error=type(exc).__name__)

    async def _adjust(self, scope: str, window: int, delta: int) -> None:
        """A refund goes back to the minute that was charged; an overrun is charged to this one."""
        if delta < 0:
            await self.storage.incr(self._key("tok", f"{scope}:{window}"), WINDOW_S + 5, amount=delta)
        elif delta > 0:
            now, _ = _window()
            await self.storage.incr(self._key("tok", f"{scope}:{now}"), WINDOW_S + 5, amount=delta)


def _redacted(uri: str) -> str:
    """The storage URI without a password (redis://user:secret@host)."""
    scheme, _, rest = uri.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


def _set_headers(headers: dict[str, str], kind: str, limit: int, remaining: int, reset: float) -> None:
    """OpenAI's x-ratelimit-* headers; with two scopes the tighter one is reported."""
    remaining = max(0, remaining)
    current = headers.get(f"x-ratelimit-remaining-{kind}")
    if current is not None and int(current) <= remaining:
        return
    headers[f"x-ratelimit-limit-{kind}"] = str(limit)
    headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
    headers[f"x-ratelimit-reset-{kind}"] = f"{max(0, math.ceil(reset - time.time()))}s"


@dataclass
class _Over:
    """Builds a scope's 429s, each naming the policy field that would let the request through."""

    principal: Principal
    access: Access
    kind: str  # "key" or "tenant"
    headers: dict[str, str]

    @property
    def who(self) -> str:
        if self.kind == "tenant":
            return f"tenant '{self.principal.tenant}'"
        p = self.principal
        return f"key '{p.key_id}' of '{p.id}'" if p.key_id else f"subject '{p.id}'"

    def reached(self, name: str, limit: int, reason: str, wait_s: float, other: str = "") -> Refusal:
        retry = max(1, math.ceil(wait_s))
        then = other or f"retry after {retry} s"
        message = (f"{self.who} {name} ({limit}) reached; raise {self.access.limit_field(self.kind, name)} "
                   f"in the policy or {then}.")
        return Refusal(429, message, reason, headers={"retry-after": str(retry)})

    def never(self, name: str, limit: int, need: str, lower: str) -> Refusal:
        """A request larger than the whole limit: waiting would not help."""
        field_path = self.access.limit_field(self.kind, name)
        message = f"This request {need}, more than {self.who} {name} ({limit}); {lower}, or raise {field_path} in the policy."
        reason = "concurrency_limit" if name == "concurrent_requests" else "token_rate_limit"
        return Refusal(429, message, reason)


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
