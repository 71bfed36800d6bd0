"""Per-key and per-tenant limits: requests/min, tokens/min, concurrent sequences, and token and
request budgets per UTC day and month.

Counters live in `limits`' async storage (memory by default, Redis when gateway workers or
replicas must share them). Requests per minute use the library's moving window: exact, no 60 s
span ever admits more than the limit. Tokens per minute use its sliding-window counter (this
minute's count plus the last minute's, weighted by how much of it still overlaps the last 60 s),
which can be adjusted after the fact: a request reserves its worst-case token cost at admission
(so one request cannot overshoot by n x prompts x max_tokens) and settles to what it really used
at the end. Budgets count in calendar periods (a day ends at 00:00 UTC, a month on the 1st), so
their counters are plain per-period keys, reserved and settled the same way. Concurrency is
counted in sequences (n x prompts), the engine's unit of work. Every counter is named by its
scope and window, never by its limit, so an edited limit applies at once to what was already
counted. When the storage fails, the policy's `rate_limits.on_storage_error` says whether
requests are refused (503) or served unlimited.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from typing import NamedTuple

import structlog
from limits.aio.storage import MemoryStorage, Storage
from limits.errors import StorageError
from limits.storage import storage_from_string
from limits.storage.base import TimestampedSlidingWindow

from portcullis.gateway.access import Access
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.budgets import Counter, budget_counters
from portcullis.gateway.compat.limits import PacedMemoryStorage, window_keys
from portcullis.gateway.errors import Refusal
from portcullis.gateway.policy.models import Budgets, utc_period

log = structlog.get_logger("portcullis.gateway.ratelimit")

SLOT_LEASE_S = 900  # longer than any request; a crashed replica's slots lapse after this
WINDOW_S = 60
BUDGET_GRACE_S = 3600  # a period's counter outlives it, so requests still running can settle into it
STORAGE_DOWN = "rate_limits_unavailable"
BUDGETS = (("requests", "day"), ("requests", "month"), ("tokens", "day"), ("tokens", "month"))


def _storage_errors() -> tuple[type[Exception], ...]:
    """What a failing storage raises; anything else is a bug and must not read as an outage."""
    try:
        from redis.exceptions import RedisError  # optional until a policy names Redis
    except ImportError:
        return (OSError, StorageError)
    return (OSError, StorageError, RedisError)


STORAGE_ERRORS = _storage_errors()


@dataclass(frozen=True)
class Period:
    """One UTC calendar day or month: budgets count from zero again at `ends`."""

    name: str  # "day" or "month"
    id: str  # 2026-12-02 or 2026-12: part of the counter's key
    ends: float

    @staticmethod
    def at(name: str, now: float) -> Period:
        return _period(name, int(now // 86400))  # Unix time has no leap seconds: a UTC day is 86400 s


@lru_cache(maxsize=16)
def _period(name: str, day: int) -> Period:
    """Built once per day and name: datetime arithmetic costs more than the rest of a check."""
    start, end = utc_period(name, datetime.fromtimestamp(day * 86400, timezone.utc))
    return Period(name, start.strftime("%Y-%m-%d" if name == "day" else "%Y-%m"), end.timestamp())


class Charge(NamedTuple):  # a tuple: up to ten are made per request, a frozen dataclass costs 4x
    """What one admission added to one counter, so it can be settled or given back."""

    key: str
    amount: int
    at: float
    minute: bool = False  # a tokens-per-minute sliding-window counter, else a budget period's counter
    # For a minute counter: the storage key of the minute charged and when that minute stops being
    # the current one. Until then settling is one increment of that key, with no read first.
    window_key: str = ""
    minute_ends: float = 0.0


@dataclass
class Admission:
    """What a request took from the limits; settled exactly once when it ends."""

    principal: Principal
    access: Access
    slots: list[tuple[str, str, int]] = field(default_factory=list)  # (counter, lease, sequences)
    reservations: list[Charge] = field(default_factory=list)  # tokens: settled to what was used
    requests: list[Charge] = field(default_factory=list)  # request budgets: given back only on release
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
        return PacedMemoryStorage()
    return storage_from_string(f"async+{uri}", implementation="redispy")


class RateLimiter:
    def __init__(self, uri: str, prefix: str, clock: Callable[[], float] = time.time) -> None:
        self.uri = uri
        self.prefix = prefix
        self.storage = _storage(uri)
        # The storage's moving-window and sliding-window calls are used directly (the strategies
        # MovingWindowRateLimiter and SlidingWindowCounterRateLimiter wrap them one to one), on
        # keys of our own: see `_counter_key`.
        self.local = uri.startswith("memory://")
        self.slots = ConcurrencySlots() if self.local else RedisConcurrencySlots(uri)
        self.budgets = budget_counters(uri, self.storage)
        self.budget_plan = lru_cache(maxsize=4096)(self._budget_plan)
        self.clock = clock  # where budgets' periods begin and end; tests move it across a boundary

    async def close(self) -> None:
        await self.slots.close()

    def _key(self, kind: str, scope: str) -> str:
        return f"{self.prefix}:{kind}:{scope}"

    def _counter_key(self, kind: str, scope: str) -> str:
        """The storage key of `scope`'s per-minute counter of `kind` ("req" or "tok"). Not
        `limits`' `RateLimitItem.key_for`: its key holds the limit, so an edited limit started an
        empty window and a tenant just refused was served again at once (issue 29, finding 10)."""
        return f"{self.prefix}:{kind}:{WINDOW_S}s:{scope}"

    def _budget_plan(self, scope: str, budgets: Budgets, day: int) -> list[tuple[str, Period, int, str, str]]:
        """(unit, period, limit, counter key, header kind) for each budget `budgets` sets, on this
        UTC day."""
        return [(unit, period, limit, self._key(f"budget:{unit}:{period.id}", scope), f"{unit}-{name}")
                for unit, name in BUDGETS if (limit := getattr(budgets, f"{unit}_per_{name}")) is not None
                for period in [_period(name, day)]]

    def _scopes(self, principal: Principal, access: Access) -> list[tuple[str, str, object]]:
        """(counter scope, "key" or "tenant", its limits)."""
        return [(principal.limit_id, "key", access.key_limits),
                (f"tenant:{principal.tenant}", "tenant", access.tenant_limits)]

    async def admit(self, principal: Principal, access: Access, tokens: int = 0, sequences: int = 1,
                    on_storage_error: str = "refuse") -> Admission:
        """Take slots for `sequences`, a request and a reservation of `tokens` from each scope's
        minute limits and budgets, or refuse with 429 (giving back what was taken)."""
        admission = Admission(principal, access, limiter=self)
        scopes = [(scope, _Over(principal, access, kind, admission.headers), limits)
                  for scope, kind, limits in self._scopes(principal, access)]
        try:
            # Every limit of both scopes is checked before a request is counted: slots, tokens and
            # budgets are given back when another limit refuses, a request per minute cannot be
            # (a moving window's entry stays 60 s). So a request any limit refuses spends no other.
            await self._all(*(step for scope, over, limits in scopes for step in (
                self._check_requests(admission, scope, over, limits.requests_per_minute),
                self._take_slots(admission, scope, over, limits.concurrent_requests, sequences),
                self._reserve_tokens(admission, scope, over, limits.tokens_per_minute, tokens),
                self._charge_budgets(admission, scope, over, limits.budgets, tokens))))
            # The tenant's first, the window other keys race for: only a request that takes its
            # tenant's last entry between the check and here (on Redis) can still spend its key's.
            for scope, over, limits in reversed(scopes):
                await self._count_request(scope, over, limits.requests_per_minute)
        except Refusal as refusal:
            await self.release(admission)
            refusal.headers = {**admission.headers, **refusal.headers}
            raise
        except STORAGE_ERRORS as exc:
            await self.release(admission)
            return self._storage_failed(admission, exc, on_storage_error)
        return admission

    async def _all(self, *steps: Awaitable[None]) -> None:
        """Run one scope's counters, which do not depend on each other. On Redis they run at once,
        so a scope costs one round trip's wait, not one per counter; every step finishes even when
        another refuses, so whatever it took is in the admission for `release` to give back. In
        memory there is nothing to wait for and tasks would cost more than they save: in order,
        stopping at the first refusal. Either way the first refusal in order is the one raised."""
        if self.local:
            pending = list(steps)
            try:
                while pending:
                    await pending.pop(0)
            finally:
                for step in pending:
                    step.close()  # type: ignore[attr-defined]  # never started: no "never awaited" warning
            return
        results = await asyncio.gather(*steps, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

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
                             "lower n or the number of prompts or inputs", "concurrency_limit")
        name = self._key("conc", scope)
        lease = await self.slots.acquire(name, limit, sequences)
        if lease is None:
            raise over.reached("concurrent_requests", limit, "concurrency_limit", 1,
                               "retry when a request in flight ends")
        admission.slots.append((name, lease, sequences))

    async def _check_requests(self, admission: Admission, scope: str, over: _Over, limit: int | None) -> None:
        """Whether the scope has a request left this minute, taking nothing (`_count_request` does)."""
        if limit is None:
            return
        start, count = await self.storage.get_moving_window(  # type: ignore[attr-defined]
            self._counter_key("req", scope), limit, WINDOW_S)
        wait = start + WINDOW_S - time.time()  # until the oldest request in the window leaves it
        _set_headers(admission.headers, "requests", limit, limit - count - 1, wait)
        if count >= limit:
            raise over.reached("requests_per_minute", limit, "request_rate_limit", wait)

    async def _count_request(self, scope: str, over: _Over, limit: int | None) -> None:
        """A moving window: the request counts for exactly 60 s from when it came."""
        if limit is None:
            return
        key = self._counter_key("req", scope)
        if not await self.storage.acquire_entry(key, limit, WINDOW_S):  # type: ignore[attr-defined]
            # Taken since the check by a request that raced this one (another worker or replica).
            start, _ = await self.storage.get_moving_window(key, limit, WINDOW_S)  # type: ignore[attr-defined]
            raise over.reached("requests_per_minute", limit, "request_rate_limit", start + WINDOW_S - time.time())

    async def _reserve_tokens(self, admission: Admission, scope: str, over: _Over, limit: int | None,
                              tokens: int) -> None:
        if limit is None:
            return
        if tokens > limit:
            raise over.never("tokens_per_minute", limit, f"may use up to {tokens} tokens", LOWER_TOKENS)
        key = self._counter_key("tok", scope)
        # All or nothing, checked and added in one step (one Lua script on Redis).
        taken = await self.storage.acquire_sliding_window_entry(  # type: ignore[attr-defined]
            key, limit, WINDOW_S, tokens) if tokens else None
        now, window = time.time(), await self._token_window(key)
        if taken is None:  # nothing reserved: the window read answers what sliding.test would
            taken = window.weighted < limit
        if taken:  # even with nothing reserved: settle bills what the request used
            admission.reservations.append(Charge(key, tokens, now, minute=True, window_key=_window_keys(
                self.storage, key, now)[1], minute_ends=now + window.current_ttl - WINDOW_S))
        _set_headers(admission.headers, "tokens", limit, limit - math.floor(window.weighted), window.empty_in)
        if not taken:
            raise over.reached("tokens_per_minute", limit, "token_rate_limit", window.fits_in(limit, max(1, tokens)))

    async def tokens_used(self, scope: str) -> int:
        """What `tokens_per_minute` counts for `scope` (`tenant:NAME`, or a principal's
        `limit_id`) now: reservations held and usage settled in the last 60 s."""
        return math.floor((await self._token_window(self._counter_key("tok", scope))).weighted)

    async def _token_window(self, key: str) -> _SlidingWindow:
        return _SlidingWindow(*await self.storage.get_sliding_window(key, WINDOW_S))  # type: ignore[attr-defined]

    async def _charge_budgets(self, admission: Admission, scope: str, over: _Over, budgets: Budgets | None,
                              tokens: int) -> None:
        """Add this request (and its worst-case tokens) to each of the scope's budgets for the
        current period, in one storage call: all of them, or none when one is over. A budget
        over refuses until its period ends (admit gives the other scope's charges back)."""
        if budgets is None:
            return
        now = self.clock()
        charged = self.budget_plan(scope, budgets, int(now // 86400))  # Unix days: see Period.at
        if not charged:
            return
        counters = [Counter(key, 1 if unit == "requests" else tokens, limit, math.ceil(period.ends - now) + BUDGET_GRACE_S)
                    for unit, period, limit, key, _ in charged]
        used, taken = await self.budgets.charge(counters)
        for (unit, period, limit, _, kind), counter, count in zip(charged, counters, used, strict=True):
            if taken:  # a tokens budget keeps its charge even at 0 reserved, so settle bills what was used
                (admission.requests if unit == "requests" else admission.reservations).append(
                    Charge(counter.key, counter.amount, now))
            left = limit - count + (0 if taken else counter.amount)  # a refused request takes nothing
            _set_headers(admission.headers, kind, limit, left, period.ends - now)
        if taken:
            return
        for (unit, period, limit, _, _), counter, count in zip(charged, counters, used, strict=True):
            name = f"budgets.{unit}_per_{period.name}"
            if counter.amount > limit:  # only tokens can: every request budget is at least 1
                raise over.never(name, limit, f"may use up to {tokens} tokens", LOWER_TOKENS, "token_budget")
            if counter.refused(count):
                raise over.spent(name, limit, f"{unit[:-1]}_budget", period, now)

    async def settle(self, admission: Admission, tokens: int) -> None:
        """Charge what the request really used (its reservations adjusted to it) and give the
        slots back."""
        await self._end(admission, tokens, served=True)

    async def release(self, admission: Admission) -> None:
        """Give everything back: the request never reached the engine."""
        await self._end(admission, 0, served=False)

    async def _end(self, admission: Admission, tokens: int, served: bool) -> None:
        if admission.settled:
            return
        admission.settled = True
        reservations, admission.reservations = admission.reservations, []
        requests, admission.requests = admission.requests, []
        slots, admission.slots = admission.slots, []
        steps = [self.slots.release(name, lease, count) for name, lease, count in slots]  # first: others wait on them
        steps += [self._adjust(charge, tokens - charge.amount) for charge in reservations if charge.minute]
        budgets = [(charge.key, tokens - charge.amount) for charge in reservations if not charge.minute]
        if not served:  # a request that never ran costs no budget
            budgets += [(charge.key, -charge.amount) for charge in requests]
        if budgets := [(key, delta) for key, delta in budgets if delta]:
            steps.append(self.budgets.adjust(budgets, BUDGET_GRACE_S))  # every budget of both scopes at once
        try:
            await self._all(*steps)
        except STORAGE_ERRORS as exc:  # Redis slots lapse on their own, counters with their window
            log.warning("rate_limit_storage_failed", storage=_redacted(self.uri), error=type(exc).__name__)

    async def _adjust(self, charge: Charge, delta: int) -> None:
        """A tokens-per-minute charge settled: a refund goes back to the minute that was charged
        (none once that minute has left the window); an overrun is charged to this one. (Budgets'
        period counters take the difference whenever it comes: `_end` adds it.)"""
        if delta == 0:
            return
        now = time.time()
        if now < charge.minute_ends:  # the minute charged is still the current one
            await self.storage.incr(charge.window_key, 2 * WINDOW_S, amount=delta)
            return
        window = _SlidingWindow(*await self.storage.get_sliding_window(charge.key, WINDOW_S))
        previous, current = _window_keys(self.storage, charge.key, now)
        started = now - (2 * WINDOW_S - window.current_ttl)  # when the current minute began
        if delta > 0 or charge.at >= started:
            await self.storage.incr(current, 2 * WINDOW_S, amount=delta)
        elif charge.at >= started - WINDOW_S:
            await self.storage.incr(previous, 2 * WINDOW_S, amount=delta)


LOWER_TOKENS = "set a lower max_tokens or n, or send a shorter prompt or input"


@dataclass(frozen=True)
class _SlidingWindow:
    """The sliding-window counter's state as `limits` reports it (times in seconds from now)."""

    previous: int
    previous_ttl: float  # until the previous minute stops counting at all
    current: int
    current_ttl: float  # until the current minute stops counting (its end + 60 s)

    @property
    def weighted(self) -> float:
        return self.previous * self.previous_ttl / WINDOW_S + self.current

    @property
    def empty_in(self) -> float:
        """Until nothing counts any more: the limit is whole again."""
        return self.current_ttl if self.current > 0 else self.previous_ttl if self.previous > 0 else 0.0

    def fits_in(self, limit: int, cost: int) -> float:
        """Seconds until `cost` more fit: the previous minute fades first, then this one."""
        excess = self.weighted + cost - limit
        fading = self.previous * self.previous_ttl / WINDOW_S
        if self.previous and excess <= fading:
            return excess * WINDOW_S / self.previous
        ends = max(0.0, self.current_ttl - WINDOW_S)
        rest = self.current + cost - limit
        return ends + (rest * WINDOW_S / self.current if self.current and rest > 0 else 0.0)


def _window_keys(storage: Storage, key: str, now: float) -> tuple[str, str]:
    """The storage keys of the previous and current minute of a sliding-window counter: memory
    names them by the clock's minute (public), Redis by `compat.limits.window_keys`."""
    if isinstance(storage, TimestampedSlidingWindow):
        return storage.sliding_window_keys(key, WINDOW_S, now)
    return window_keys(storage, key)


def _redacted(uri: str) -> str:
    """The storage URI without a password (redis://user:secret@host)."""
    scheme, _, rest = uri.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


def _set_headers(headers: dict[str, str], kind: str, limit: int, remaining: int, reset_in: float) -> None:
    """OpenAI's x-ratelimit-* headers (`kind` is requests, tokens, or a budget such as
    tokens-day); with two scopes the tighter one is reported."""
    limit_name, remaining_name, reset_name = _header_names(kind)
    remaining = max(0, remaining)
    current = headers.get(remaining_name)
    if current is not None and int(current) <= remaining:
        return
    headers[limit_name] = str(limit)
    headers[remaining_name] = str(remaining)
    headers[reset_name] = f"{max(0, math.ceil(reset_in))}s"


@lru_cache(maxsize=64)
def _header_names(kind: str) -> tuple[str, str, str]:
    """Built once per kind: up to twelve are set per request."""
    return f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}"


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

    def never(self, name: str, limit: int, need: str, lower: str, reason: str = "token_rate_limit") -> Refusal:
        """A request larger than the whole limit: waiting would not help."""
        field_path = self.access.limit_field(self.kind, name)
        message = f"This request {need}, more than {self.who} {name} ({limit}); {lower}, or raise {field_path} in the policy."
        return Refusal(429, message, reason)

    def spent(self, name: str, limit: int, reason: str, period: Period, now: float) -> Refusal:
        """A budget used up: it comes back whole when its period ends, so that is the wait."""
        wait = max(1, math.ceil(period.ends - now))
        resets = datetime.fromtimestamp(period.ends, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = (f"{self.who} {name} ({limit}) is used up for this UTC {period.name}; it resets at {resets} "
                   f"(in {_duration(wait)}). Raise {self.access.limit_field(self.kind, name)} in the policy, "
                   "or retry then.")
        return Refusal(429, message, reason, headers={"retry-after": str(wait)})


def _duration(seconds: int) -> str:
    """A wait as people read it, to its two largest units: 1m 40s, 5h 3m, 12d 4h."""
    units = [(86400, "d"), (3600, "h"), (60, "m"), (1, "s")]
    parts = []
    for size, name in units:
        count, seconds = divmod(seconds, size)
        if count or parts:
            parts.append(f"{count}{name}")
    return " ".join(p for p in parts[:2] if not p.startswith("0")) or "0s"


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
