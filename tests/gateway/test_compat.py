"""Contract tests for what the gateway relies on of libraries' internals (`gateway.compat`):
each fails on a release of the library that changes it, before the trick breaks silently."""
from __future__ import annotations

import asyncio
import inspect

import limits.aio.storage.memory as limits_memory
from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage
from limits.aio.strategies import MovingWindowRateLimiter
from uvicorn.config import Config
from uvicorn.server import ServerState

from portcullis.gateway.compat import uvicorn as compat_uvicorn
from portcullis.gateway.compat.limits import PacedMemoryStorage, window_keys


def test_limits_still_has_the_private_expiry_hook_and_wraps_what_is_unwrapped():
    assert callable(getattr(MemoryStorage, "_MemoryStorage__schedule_expiry", None))
    for name in ("get", "incr", "acquire_entry", "get_moving_window", "acquire_sliding_window_entry",
                 "get_sliding_window"):
        assert inspect.iscoroutinefunction(getattr(PacedMemoryStorage, name)), name


async def test_the_memory_storage_cleans_up_at_most_once_a_second(monkeypatch):
    """`limits`' memory storage would start a thread-pool clean-up pass after every request (a
    thread round trip each, about 1 ms of CPU at one client); paced, 200 requests make one, and
    the window still counts exactly."""
    passes = 0
    real = asyncio.to_thread

    async def counted(*args, **kwargs):
        nonlocal passes
        passes += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(limits_memory.asyncio, "to_thread", counted)
    window = MovingWindowRateLimiter(PacedMemoryStorage())
    item = RateLimitItemPerMinute(150)
    admitted = 0
    for _ in range(200):
        admitted += await window.hit(item, "req", "k")
        await asyncio.sleep(0)  # let a scheduled pass run, as between requests
    assert admitted == 150 and passes <= 2


async def _noop(scope, receive, send) -> None:
    return None


def test_uvicorn_h11_protocol_has_what_the_connection_guards_use():
    config = Config(_noop)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = compat_uvicorn.H11Protocol(config, ServerState(), {}, loop)
    finally:
        loop.close()
    missing = [name for name in compat_uvicorn.ATTRIBUTES if not hasattr(protocol, name)]
    assert not missing, f"uvicorn's H11Protocol no longer sets {missing}: gateway.connection relies on them"
    missing = [name for name in compat_uvicorn.METHODS if not callable(getattr(protocol, name, None))]
    assert not missing, f"uvicorn's H11Protocol no longer has {missing}"


def test_limits_redis_storage_still_names_its_sliding_window_keys_as_the_refund_expects():
    """A refund on Redis decrements the keys the sliding-window strategy counts in; the library
    names them with private helpers, so a release that renames them must fail here."""
    storage = object.__new__(RedisStorage)  # the helpers read no connection state
    assert window_keys(storage, "LIMITER/tenant/a") == ("{LIMITER/tenant/a}/-1", "{LIMITER/tenant/a}")
