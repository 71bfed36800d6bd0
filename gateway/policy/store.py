"""`PolicyStore`: the policy currently in force, swapped atomically when its files change.

Requests read `store.current` once and keep that snapshot to the end, so a reload never
changes the rules under a request in flight and never drops it. A bad edit is logged with
file, line and reason and the last good policy keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import structlog

from gateway.policy.loader import LoadedPolicy, PolicyError, load_policy, resolve_relative

log = structlog.get_logger("gateway.policy")

Fingerprint = tuple[tuple[str, int, int, int], ...]


def _fingerprint(paths: tuple[Path, ...]) -> Fingerprint:
    """mtime, size and inode of each file: editors that save by rename change the inode."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((str(path), st.st_mtime_ns, st.st_size, st.st_ino))
        except FileNotFoundError:
            out.append((str(path), 0, -1, 0))
    return tuple(out)


class PolicyStore:
    def __init__(self, path: Path | str, interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self.current: LoadedPolicy = load_policy(self.path)
        self.last_error: PolicyError | None = None
        self.generation = 0
        self._listeners: list[Callable[[LoadedPolicy], None]] = []
        self._seen = _fingerprint(self._watched(self.current))
        self._task: asyncio.Task[None] | None = None

    def on_change(self, listener: Callable[[LoadedPolicy], None]) -> None:
        self._listeners.append(listener)

    def _watched(self, loaded: LoadedPolicy) -> tuple[Path, ...]:
        paths = [self.path]
        if loaded.policy.keys_file:
            paths.append(resolve_relative(self.path, loaded.policy.keys_file))
        return tuple(paths)

    def changed(self) -> bool:
        """True (once) when a watched file changed since the last look."""
        seen = _fingerprint(self._watched(self.current))
        if seen == self._seen:
            return False
        self._seen = seen
        return True

    def reload(self) -> bool:
        """Load and apply now; False (old policy kept, error logged) when the edit is invalid."""
        loaded = self._try_load()
        if loaded is not None:
            self._apply(loaded)
        return loaded is not None

    def _try_load(self) -> LoadedPolicy | None:
        try:
            return load_policy(self.path)
        except PolicyError as exc:
            self.last_error = exc
            # `error` is the ready-made `file:line: reason`; the fields are for log queries.
            log.error("policy_reload_refused", error=str(exc), file=exc.path, line=exc.line, reason=exc.reason,
                      still_serving_generation=self.generation)
            return None

    def _apply(self, loaded: LoadedPolicy) -> None:
        self.current, self.last_error = loaded, None
        self.generation += 1
        # A new keys_file entry must itself be watched from now on.
        self._seen = _fingerprint(self._watched(loaded))
        for listener in self._listeners:
            listener(loaded)
        log.info("policy_reloaded", file=str(self.path), generation=self.generation)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if self.changed():
                    # Parsing runs in a thread; applying runs on the loop, so listeners never race.
                    loaded = await asyncio.to_thread(self._try_load)
                    if loaded is not None:
                        self._apply(loaded)
            except Exception:  # a watcher that dies would silently freeze the policy
                log.exception("policy_watch_failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
