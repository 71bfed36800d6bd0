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


def _protocol(loop: asyncio.AbstractEventLoop) -> compat_uvicorn.H11Protocol:
    config = Config(_noop)
    config.load()
    return compat_uvicorn.H11Protocol(config, ServerState(), {}, loop)


class FakeTransport(asyncio.Transport):
    """What a connection needs of its transport: a peer's address, and somewhere to write."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = bytearray(), False

    def get_extra_info(self, name, default=None):
        return {"peername": ("10.0.0.7", 4242), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_uvicorn_h11_protocol_has_what_the_connection_guards_use():
    loop = asyncio.new_event_loop()
    try:
        protocol = _protocol(loop)
    finally:
        loop.close()
    missing = [name for name in compat_uvicorn.ATTRIBUTES if not hasattr(protocol, name)]
    assert not missing, f"uvicorn's H11Protocol no longer sets {missing}: gateway.connection relies on them"
    missing = [name for name in compat_uvicorn.METHODS if not callable(getattr(protocol, name, None))]
    assert not missing, f"uvicorn's H11Protocol no longer has {missing}"


async def test_uvicorn_h11_connection_sets_and_reads_what_the_guards_use():
    """A connection made on a transport, then two requests: the swapped-in `app` runs each; the
    cycle says where its response stands; setting `disconnected` and `message_event`, as a guard
    refusing a slow body does, makes the application's receive() answer http.disconnect."""
    protocol, transport, seen = _protocol(asyncio.get_running_loop()), FakeTransport(), []

    async def app(scope, receive, send):
        cycle = protocol.cycle
        seen.append((cycle.scope is scope, cycle.response_started, cycle.response_complete))
        if scope["method"] == "POST":  # its body never comes: the guard ends it
            cycle.disconnected = True
            cycle.message_event.set()
            seen.append((await receive())["type"])
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        seen.append((cycle.response_started, cycle.response_complete))
        await send({"type": "http.response.body", "body": b"ok"})

    protocol.app = app
    protocol.connection_made(transport)
    assert (protocol.transport, protocol.client) == (transport, ("10.0.0.7", 4242))
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: gw\r\n\r\n")
    cycle = protocol.cycle
    missing = [name for name in compat_uvicorn.CONNECTION_ATTRIBUTES if getattr(protocol, name, None) is None]
    assert not missing, f"uvicorn's H11Protocol no longer sets {missing} for a connection and its request"
    missing = [name for name in compat_uvicorn.CYCLE_ATTRIBUTES if not hasattr(cycle, name)]
    assert not missing, f"uvicorn's request cycle no longer has {missing}: gateway.connection relies on them"
    await asyncio.gather(*protocol.tasks)
    assert cycle.response_complete and transport.written.startswith(b"HTTP/1.1 200")
    protocol.data_received(b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 5\r\n\r\n")
    await asyncio.gather(*protocol.tasks)
    assert seen == [(True, False, False), (True, False), (True, False, False), "http.disconnect"]
    protocol.connection_lost(None)
    assert not protocol.connections and protocol.timeout_keep_alive_task is None


async def test_uvicorn_h11_protocol_hands_bytes_that_are_not_http_to_send_400_response():
    protocol, refused = _protocol(asyncio.get_running_loop()), []
    protocol.send_400_response = refused.append  # the guards answer it with an OpenAI body
    protocol.connection_made(FakeTransport())
    protocol.data_received(b"\x16\x03\x01 not HTTP\r\n\r\n")
    assert len(refused) == 1
    protocol.connection_lost(None)


def test_limits_redis_storage_still_names_its_sliding_window_keys_as_the_refund_expects():
    """A refund on Redis decrements the keys the sliding-window strategy counts in; the library
    names them with private helpers, so a release that renames them must fail here."""
    storage = object.__new__(RedisStorage)  # the helpers read no connection state
    assert window_keys(storage, "LIMITER/tenant/a") == ("{LIMITER/tenant/a}/-1", "{LIMITER/tenant/a}")
