"""Cost of one request's rate-limit work: RateLimiter.admit + settle, key and tenant scopes each
with requests/min and tokens/min (optionally budgets), on memory:// and on a Redis URL.

    python benchmarks/limiter_cost.py [--redis redis://HOST:6379/0] [--budgets] [-n 2000] [--against OLD.py]

Prints the median microseconds per request for each storage, and the Redis commands per request
(client calls: each is one round trip). --against takes another version of gateway/ratelimit.py
(`git show REV:gateway/ratelimit.py > old.py`) and alternates rounds of both in one run, so a
shared machine's noise falls on both alike; it prints each one's median and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
import uuid
from types import SimpleNamespace

from portcullis.gateway.policy.models import Budgets, Limits
from portcullis.gateway.ratelimit import RateLimiter


def _access(budgets: bool) -> SimpleNamespace:
    extra = {"budgets": Budgets(tokens_per_day=10**12, requests_per_day=10**12)} if budgets else {}
    limits = Limits(requests_per_minute=10**9, tokens_per_minute=10**12, **extra)
    return SimpleNamespace(key_limits=limits, tenant_limits=limits, limit_field=lambda kind, name: name)


def _load(path: str) -> type:
    spec = importlib.util.spec_from_file_location("ratelimit_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.RateLimiter


async def _run(limiter_class: type, uri: str, n: int, budgets: bool) -> tuple[list[float], float | None]:
    limiter = limiter_class(uri, f"bench{uuid.uuid4().hex[:6]}")
    principal = SimpleNamespace(limit_id="key:k1", tenant="t1", key_id="k1", id="p1")
    access = _access(budgets)
    before = CALLS[0]
    times = []
    for _ in range(n):
        start = time.perf_counter()
        admission = await limiter.admit(principal, access, tokens=200)
        await limiter.settle(admission, 120)
        times.append(time.perf_counter() - start)
    per_request = (CALLS[0] - before) / n if uri.startswith("redis") else None
    await limiter.close()
    return times, per_request


CALLS = [0]


def _count_round_trips() -> None:
    """Count every command and pipeline the Redis client sends: one round trip each."""
    from redis.asyncio.client import Pipeline, Redis

    for cls, name in ((Redis, "execute_command"), (Pipeline, "execute")):
        original = getattr(cls, name)

        async def counted(self, *args, _original=original, **kwargs):
            CALLS[0] += 1
            return await _original(self, *args, **kwargs)

        setattr(cls, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default=None)
    parser.add_argument("--budgets", action="store_true")
    parser.add_argument("--against", default=None, help="another ratelimit.py to alternate with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-n", type=int, default=2000)
    args = parser.parse_args()
    if args.redis:
        _count_round_trips()
    versions = {"this": RateLimiter} | ({"against": _load(args.against)} if args.against else {})
    for uri in ["memory://"] + ([args.redis] if args.redis else []):
        n = args.n if uri == "memory://" else args.n // 10
        times: dict[str, list[float]] = {name: [] for name in versions}
        commands: dict[str, float | None] = {}
        for _ in range(args.rounds):
            for name, limiter_class in versions.items():
                round_times, commands[name] = asyncio.run(_run(limiter_class, uri, n, args.budgets))
                times[name] += round_times
        medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        for name, median_us in medians.items():
            shown = "" if commands[name] is None else f", {commands[name]:.1f} Redis calls/request"
            print(f"{uri.split(':')[0]:7s} budgets={args.budgets} {name:8s}: median {median_us:.0f} us{shown}")
        if args.against:
            print(f"{uri.split(':')[0]:7s} budgets={args.budgets} this/against: {medians['this'] / medians['against']:.2f}")


if __name__ == "__main__":
    main()
