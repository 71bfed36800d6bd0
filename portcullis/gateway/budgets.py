"""Budget counters: one total per scope, unit and UTC period, kept beside the rate limits.

A request's budgets in one scope (requests and tokens, per day and per month) are charged in
one step, all or nothing: when one would go over, none is added. In memory that is a dict
update; on Redis it is one Lua script, one round trip however many budgets the scope sets.
Counters sit under the keys `limits`' storage used before (its `LIMITS:` prefix on Redis),
so a gateway upgraded mid-period keeps counting what it had counted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from limits.aio.storage import Storage


class Counter(NamedTuple):  # a tuple: made for every budget of every request
    """One budget's part in a charge: its counter, what this request adds, its limit, and how
    long a counter this charge creates is kept (its period plus a grace for late settles)."""

    key: str
    amount: int
    limit: int
    expiry_s: int

    def refused(self, used: int) -> bool:
        """`used` counts this charge; with nothing to add, a budget already spent refuses."""
        return used > self.limit if self.amount else used >= self.limit


class BudgetCounters(Protocol):
    async def charge(self, counters: Sequence[Counter]) -> tuple[list[int], bool]:
        """Add every amount, or none when any counter would refuse. Returns each counter's
        count with its amount added (whether or not it was) and whether they were added."""

    async def adjust(self, deltas: Sequence[tuple[str, int]], expiry_s: int) -> None:
        """Add each delta (settling a reservation, giving a charge back) without a check; a
        counter this creates is kept `expiry_s`."""


class MemoryBudgetCounters:
    """In this process only (`memory://`): gone at restart, one per worker."""

    SWEEP_EVERY_S = 60.0

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._ends: dict[str, float] = {}
        self._swept_at = 0.0

    async def charge(self, counters: Sequence[Counter]) -> tuple[list[int], bool]:
        now = time.time()  # the clock `limits` keeps its counters by (tests move it)
        used = [self._count(c.key, now) + c.amount for c in counters]
        taken = not any(c.refused(u) for c, u in zip(counters, used, strict=True))
        if taken:
            for counter in counters:
                self._add(counter.key, counter.amount, counter.expiry_s, now)
        return used, taken

    async def adjust(self, deltas: Sequence[tuple[str, int]], expiry_s: int) -> None:
        now = time.time()
        for key, delta in deltas:
            self._count(key, now)  # an expired counter starts again from zero
            self._add(key, delta, expiry_s, now)

    def _count(self, key: str, now: float) -> int:
        if self._ends.get(key, 0.0) <= now:
            self._counts.pop(key, None)
            self._ends.pop(key, None)
            return 0
        return self._counts[key]

    def _add(self, key: str, amount: int, expiry_s: int, now: float) -> None:
        if not amount:
            return
        if key not in self._counts:  # as `limits` does: a counter's expiry is set when it is made
            self._ends[key] = now + expiry_s
            self._sweep(now)
        self._counts[key] = self._counts.get(key, 0) + amount

    def _sweep(self, now: float) -> None:
        """Forget counters whose period (and grace) has passed, at most once a minute."""
        if now - self._swept_at < self.SWEEP_EVERY_S:
            return
        self._swept_at = now
        for key in [k for k, end in self._ends.items() if end <= now]:
            del self._counts[key], self._ends[key]


# KEYS: the counters; ARGV: their amounts, then their limits, then their expiries (seconds).
CHARGE = """
local n = #KEYS
local used, over = {}, 0
for i = 1, n do
    local amount = tonumber(ARGV[i])
    used[i] = tonumber(redis.call("get", KEYS[i]) or "0") + amount
    local limit = tonumber(ARGV[n + i])
    if (amount > 0 and used[i] > limit) or (amount == 0 and used[i] >= limit) then
        over = 1
    end
end
if over == 0 then
    for i = 1, n do
        local amount = tonumber(ARGV[i])
        if amount ~= 0 and redis.call("incrby", KEYS[i], amount) == amount then
            redis.call("expire", KEYS[i], ARGV[2 * n + i])
        end
    end
end
used[n + 1] = over
return used
"""

# KEYS: the counters; ARGV: their deltas, then the expiry of a counter this creates.
ADJUST = """
local n = #KEYS
for i = 1, n do
    local amount = tonumber(ARGV[i])
    if redis.call("incrby", KEYS[i], amount) == amount then
        redis.call("expire", KEYS[i], ARGV[n + 1])
    end
end
return n
"""


class RedisBudgetCounters:
    """Shared by every worker and replica on the same Redis, through the connections of the
    limiter's `limits` storage (its errors are the storage's errors)."""

    def __init__(self, storage: Storage) -> None:
        bridge = storage.bridge  # type: ignore[attr-defined]  # limits' Redis connection and key prefix
        connection = bridge.get_connection()
        self._prefixed = bridge.prefixed_key
        self._charge = connection.register_script(CHARGE)
        self._adjust = connection.register_script(ADJUST)

    async def charge(self, counters: Sequence[Counter]) -> tuple[list[int], bool]:
        args = [c.amount for c in counters] + [c.limit for c in counters] + [c.expiry_s for c in counters]
        *used, over = await self._charge(keys=[self._prefixed(c.key) for c in counters], args=args)
        return [int(u) for u in used], not over

    async def adjust(self, deltas: Sequence[tuple[str, int]], expiry_s: int) -> None:
        await self._adjust(keys=[self._prefixed(key) for key, _ in deltas], args=[d for _, d in deltas] + [expiry_s])


def budget_counters(uri: str, storage: Storage) -> BudgetCounters:
    return MemoryBudgetCounters() if uri.startswith("memory://") else RedisBudgetCounters(storage)
