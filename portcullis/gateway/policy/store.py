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

from portcullis.gateway.policy.loader import (
    LoadedPolicy,
    PolicyError,
    SourceFile,
    Stamp,
    load_policy,
    reload_keys,
    stamp,
)
from portcullis.gateway.policy.models import memory_budgets_warning

log = structlog.get_logger("portcullis.gateway.policy")

Seen = dict[Path, Stamp]
# A load: the files as they are now, and (when the policy file itself is refused) the policy
# in force with its keys file read again, so a revocation never waits for a policy fix.
Outcome = tuple[LoadedPolicy | PolicyError, LoadedPolicy | None]
# The same refusal is logged again only after this long (a file flapping between a good and a
# bad version every 100 ms would otherwise log at every poll).
RELOG_AFTER_S = 300.0


def _stamps(reads: Iterable[SourceFile]) -> Seen:
    return {read.path: read.stamp for read in reads}


def _contents(reads: Iterable[SourceFile]) -> dict[Path, str]:
    return {read.path: read.digest for read in reads}


def _warn_memory_budgets(loaded: LoadedPolicy, before: LoadedPolicy | None) -> None:
    """At start, and on a reload that adds budgets (or moves them to memory://)."""
    warning = memory_budgets_warning(loaded.policy)
    if warning and (before is None or warning != memory_budgets_warning(before.policy)):
        log.warning("budgets_in_memory", warning=warning)


class PolicyStore:
    def __init__(self, path: Path | str, interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self.current: LoadedPolicy = load_policy(self.path)
        _warn_memory_budgets(self.current, None)
        self.last_error: PolicyError | None = None  # set while the files on disk are refused
        self.generation = 0
        self.refusals = 0  # reload attempts refused since start
        self.loaded_at = time.time()  # when the policy in force was applied
        self._logged: tuple[str, float] | None = None  # the refusal last logged, and when
        self._listeners: list[Callable[[LoadedPolicy], None]] = []
        self._refusal_listeners: list[Callable[[PolicyError], None]] = []  # e.g. the audit log
        # Each file as the load that is in force read it: never re-stamped after a load, or a
        # write that landed during the load would look already applied (and be lost).
        self._seen: Seen = _stamps(self.current.reads)
        self._task: asyncio.Task[None] | None = None
        self._loading = asyncio.Lock()  # one load at a time, whoever asks: the poll or a request

    def on_change(self, listener: Callable[[LoadedPolicy], None]) -> None:
        self._listeners.append(listener)

    def on_refused(self, listener: Callable[[PolicyError], None]) -> None:
        """Call `listener` once for each reload attempt that is refused."""
        self._refusal_listeners.append(listener)

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

    def _load(self) -> Outcome:
        try:
            return load_policy(self.path), None
        except PolicyError as exc:
            return exc, self._keys_alone(exc)

    def _keys_alone(self, exc: PolicyError) -> LoadedPolicy | None:
        if exc.path != str(self.path) or not self.current.policy.keys_file:
            return None
        try:
            return reload_keys(self.current)
        except PolicyError:
            return None  # the keys file is refused too; the full load's error says what to fix

    def _settle(self, outcome: Outcome) -> bool:
        result, keys_alone = outcome
        if isinstance(result, PolicyError):
            self._settle_refused(result, keys_alone)
            return False
        self._seen = _stamps(result.reads)
        if _contents(result.reads) == _contents(self.current.reads):
            self._unchanged()  # touched, or back to the version in force: nothing to apply
        else:
            self._apply(result)
        return True

    def _settle_refused(self, exc: PolicyError, keys_alone: LoadedPolicy | None) -> None:
        # Keep watching what the good policy read too: a fix may be made in either file.
        self._seen = {**self._seen, **_stamps(exc.reads)}
        if keys_alone is not None:
            self._seen.update(_stamps(r for r in keys_alone.reads if r.path != self.path))
            if _contents(keys_alone.reads) != _contents(self.current.reads):
                self._apply(keys_alone)
        self._refuse(exc)

    def _refuse(self, exc: PolicyError) -> None:
        self.last_error = exc
        self.refusals += 1
        for listener in self._refusal_listeners:
            listener(exc)
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
        _warn_memory_budgets(loaded, self.current)
        self.current, self.last_error, self._logged = loaded, None, None
        self.generation += 1
        self.loaded_at = time.time()
        for listener in self._listeners:
            listener(loaded)
        log.info("policy_reloaded", file=str(self.path), generation=self.generation)

    async def reload_if_changed(self) -> bool:
        """Apply what changed on disk now, without waiting for the poll; True when a new policy
        is in force. When nothing changed this costs a stat of each file, never a read, so a
        caller may ask on every unknown key (a key just created by `portcullis keys create`)."""
        async with self._loading:  # callers that arrive during a load share its result
            if not self.changed():
                return False
            generation = self.generation
            # Parsing runs in a thread; settling runs on the loop, so listeners never race.
            self._settle(await asyncio.to_thread(self._load))
            return self.generation != generation

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.reload_if_changed()
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
