"""What the gateway relies on of `limits`' internals, in one place (pinned by
tests/gateway/test_compat.py): its in-memory storage with the clean-up paced (a private hook
overridden), and where a sliding-window counter keeps its two minutes in a storage that does
not say (Redis: private helpers)."""
from __future__ import annotations

import inspect
import time

from limits.aio.storage import MemoryStorage, Storage


class PacedMemoryStorage(MemoryStorage):
    """`limits`' in-process storage, its clean-up paced. The library starts a pass that drops
    expired moving-window entries after every call, each key's in a thread-pool task: a thread
    round trip per request (about 1 ms of CPU at one client). Reads already skip what has
    expired, so the pass only frees memory, and once a second does that."""

    EXPIRY_EVERY_S = 1.0

    def __init__(self) -> None:
        self._expired_at = 0.0
        super().__init__()

    async def _MemoryStorage__schedule_expiry(self) -> None:  # the library's private hook, by its mangled name
        now = time.time()  # the clock the library's entries carry (tests move it)
        if abs(now - self._expired_at) >= self.EXPIRY_EVERY_S:
            self._expired_at = now
            await super()._MemoryStorage__schedule_expiry()  # type: ignore[misc]


# `limits` wraps a storage's methods in an error translator in every subclass, the window ones
# twice per class, so here each call (and each get inside an incr or a window read) went through
# two to four of them, nested; memory raises nothing to translate: the library's own methods.
for _method in ("get", "incr", "acquire_entry", "get_moving_window", "acquire_sliding_window_entry",
                "get_sliding_window"):
    setattr(PacedMemoryStorage, _method, inspect.unwrap(getattr(MemoryStorage, _method)))


def window_keys(storage: Storage, key: str) -> tuple[str, str]:
    """The storage keys of a sliding-window counter's previous and current minute in a storage
    without a public way to name them (Redis keeps "{key}" and renames it to "{key}/-1" as a minute
    ends): a refund must land where the strategy counts."""
    return storage._previous_window_key(key), storage._current_window_key(key)  # type: ignore[attr-defined]
