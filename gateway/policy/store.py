"""`PolicyStore`: the policy currently in force, swapped atomically when its files change.

Requests read `store.current` once and keep that snapshot to the end, so a reload never
changes the rules under a request in flight and never drops it. A bad edit is logged with
file, line and reason (once, however often the poll sees it) and the last good policy keeps
serving; `status()` tells readiness and metrics that the files on disk are not what serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog

from gateway.policy.loader import LoadedPolicy, PolicyError, SourceFile, Stamp, load_policy, stamp

log = structlog.get_logger("gateway.policy")

Seen = dict[Path, Stamp]
# The same refusal is logged again only after this long (a file flapping between a good and a
# bad version every 100 ms would otherwise log at every poll).
RELOG_AFTER_S = 300.0


def _stamps(reads: Iterable[SourceFile]) -> Seen:
    return {read.path: read.stamp for read in reads}


def _contents(reads: Iterable[SourceFile]) -> dict[Path, str]:
    return {read.path: read.digest for read in reads}


class PolicyStore:
    def __init__(self, path: Path | str, interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self.current: LoadedPolicy = load_policy(self.path)
        self.last_error: PolicyError | None = None  # set while the files on disk are refused
        self.generation = 0
        self.refusals = 0  # reload attempts refused since start
        self.loaded_at = time.time()  # when the policy in force was applied
        self._logged: tuple[str, float] | None = None  # the refusal last logged, and when
        self._listeners: list[Callable[[LoadedPolicy], None]] = []
        # Each file as the load that is in force read it: never re-stamped after a load, or a
        # write that landed during the load would look already applied (and be lost).
        self._seen: Seen = _stamps(self.current.reads)
        self._task: asyncio.Task[None] | None = None

    def on_change(self, listener: Callable[[LoadedPolicy], None]) -> None:
        self._listeners.append(listener)

    def status(self) -> dict[str, object]:
        """For readiness and metrics: which policy serves, and whether the files on disk were refused."""
        return {"generation": self.generation, "reload_refused": self.last_error is not None,
                "refusals": self.refusals, "loaded_at": self.loaded_at}

    def changed(self) -> bool:
        """True when a watched file differs from what the last load read."""
        return any(stamp(path) != seen for path, seen in self._seen.items())

    def reload(self) -> bool:
        """Load and apply now; False (old policy kept, error logged) when the edit is invalid."""
        return self._settle(self._load())

    def _load(self) -> LoadedPolicy | PolicyError:
        try:
            return load_policy(self.path)
        except PolicyError as exc:
            return exc

    def _settle(self, result: LoadedPolicy | PolicyError) -> bool:
        if isinstance(result, PolicyError):
            # Keep watching what the good policy read too: a fix may be made in either file.
            self._seen = {**self._seen, **_stamps(result.reads)}
            self._refuse(result)
            return False
        self._seen = _stamps(result.reads)
        if _contents(result.reads) == _contents(self.current.reads):
            self._unchanged()  # touched, or back to the version in force: nothing to apply
        else:
            self._apply(result)
        return True

    def _refuse(self, exc: PolicyError) -> None:
        self.last_error = exc
        self.refusals += 1
        now = time.monotonic()
        if self._logged and self._logged[0] == str(exc) and now - self._logged[1] < RELOG_AFTER_S:
            return
        self._logged = (str(exc), now)
        # `error` is the ready-made `file:line: reason`; the fields are for log queries.
        log.error("policy_reload_refused", error=str(exc), file=exc.path, line=exc.line, reason=exc.reason,
                  still_serving_generation=self.generation)

    def _unchanged(self) -> None:
        if self.last_error is not None:
            log.info("policy_files_valid_again", file=str(self.path), generation=self.generation)
        self.last_error = None

    def _apply(self, loaded: LoadedPolicy) -> None:
        self.current, self.last_error, self._logged = loaded, None, None
        self.generation += 1
        self.loaded_at = time.time()
        for listener in self._listeners:
            listener(loaded)
        log.info("policy_reloaded", file=str(self.path), generation=self.generation)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if self.changed():
                    # Parsing runs in a thread; settling runs on the loop, so listeners never race.
                    self._settle(await asyncio.to_thread(self._load))
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
