"""`AsyncEngine`: runs the `EngineCore` step loop on its own thread for an asyncio server.

`EngineCore` is not thread-safe, so exactly one thread ever touches it: one started here, or,
for `portcullis engine`, the process's main thread (`run_on_this_thread`), with the server's
event loop on a second thread. That matters on CPUs: OpenMP (GNU libgomp, torch's and the native
kernels') keeps a team's workers spinning between parallel regions only when the team's master is
the main thread; a team started from another thread counts as oversubscribing the cores, so its
workers sleep after each region and every kernel call pays their wake-up (measured: a SmolLM2
projection 26 µs from the main thread, 85 µs from another; decode 9.8 against 17.3 ms/token).
How long they spin is bounded (`openmp`), or they would keep a core from the server's thread and
from other engines on the host long after each step. The event loop talks to that thread
through an inbox of adds and aborts; the thread drains the inbox between steps, steps while
any request is unfinished, sleeps on a condition when idle (no busy loop), and hands each step's
outputs back to the loop with one `call_soon_threadsafe` per step. Each API call gets an
`OutputStream` carrying the outputs of its engine requests (one per choice).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from portcullis.engine.core.engine_core import EngineCore, EngineInfo
from portcullis.engine.errors import RequestError
from portcullis.engine.outputs import StepOutput
from portcullis.engine.sampling_params import SamplingParams

log = structlog.get_logger("engine")


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; no request can be served any more."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    grammar: object = None  # compiled structured-output grammar, compiled off the engine thread
    priority: int = 0
    prediction: list[int] | None = None  # token ids of the client's predicted output


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters and gauges as of the last step, replaced whole so readers need no lock."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


@dataclass
class TrackedRequest:
    """What the loop side knows of one engine request, for metrics and the request log."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason_override: str | None = None


class OutputObserver(Protocol):
    """Sees every output on the event loop (metrics, request log); must be cheap."""

    def on_output(self, tracked: TrackedRequest, out: StepOutput, now: float) -> None: ...


@dataclass(eq=False)
class OutputStream:
    """The outputs of one API call's engine requests, in step order, until all have finished."""

    request_ids: list[str]
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def _put(self, item: list[StepOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        unfinished = set(self.request_ids)
        while unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            for out in item:
                if out.finished:
                    unfinished.discard(out.request_id)
                yield out


@dataclass
class _Add:
    requests: list[EngineRequest]
    arrival_time: float
    stream: OutputStream
    accepted: asyncio.Future


class AsyncEngine:
    def __init__(self, core: EngineCore, observer: OutputObserver | None = None):
        self.core = core
        self.observer = observer
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None  # why the engine no longer takes requests
        self.failure: BaseException | None = None  # what stopped the loop, when it was not asked to stop
        # Called on the event loop when the loop dies of `failure` (the CLI exits on it).
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._cv = threading.Condition()
        self._inbox: list[_Add | tuple[str, ...]] = []
        self._pending_adds = 0  # requests in the inbox, counted as waiting for back-pressure
        self._in_hand: list[_Add | tuple[str, ...]] = []  # taken from the inbox, not yet all answered
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._on_caller = False  # the loop runs in run_on_this_thread, not on a thread of ours
        self._started = threading.Event()  # start() was called: run_on_this_thread may go
        self._done = threading.Event()  # _run returned
        self._loop: asyncio.AbstractEventLoop | None = None
        # Engine-thread side: which stream each live request id feeds.
        self._routes: dict[str, OutputStream] = {}
        if getattr(core, "workers", None) is not None:  # a rank lost while idle ends the engine now
            core.workers.on_broken = lambda exc: self._post(("broken", exc), 0)
        # Loop side: per-request timing for the observer.
        self._tracked: dict[str, TrackedRequest] = {}

    # -- life cycle (event loop side) ---------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._on_caller:
            self._started.set()
            return
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def run_on_this_thread(self, start_server: Callable[[], None], server_alive: Callable[[], bool]) -> None:
        """Start the server (on its own thread) and run the step loop on the calling thread (the
        main thread) once the server's lifespan calls `start`, until `shutdown`; returns at once
        if the server stops before starting it."""
        self._on_caller = True
        start_server()
        while not self._started.wait(0.05):
            if not server_alive():
                return
        self._run()

    async def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None or self._started.is_set():
            await asyncio.to_thread(self._done.wait)

    @property
    def info(self) -> EngineInfo:
        return self.core.info

    @property
    def is_alive(self) -> bool:
        return self._loop is not None and not self._done.is_set() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued in the core plus not yet handed to it."""
        return self.snapshot.num_waiting + self._pending_adds

    # -- requests (event loop side) -----------------------------------------------------------
    async def add(self, requests: list[EngineRequest], arrival_time: float | None = None) -> OutputStream:
        """Queue all `requests` or none: returns once the engine thread has taken them, or
        raises the core's RequestError (a bad request) or EngineDeadError."""
        if self.error is not None or self._loop is None:
            raise EngineDeadError("the engine is not running")
        taken = [r.request_id for r in requests if r.request_id in self._tracked]
        if taken:
            raise RequestError(f"request id {taken[0]!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        item = _Add(requests, arrival, OutputStream([r.request_id for r in requests]), self._loop.create_future())
        for r in requests:
            self._tracked[r.request_id] = TrackedRequest(r.request_id, arrival, len(r.prompt_token_ids))
        self._post(item, len(requests))
        try:
            await asyncio.shield(item.accepted)
        except asyncio.CancelledError:
            self.abort(item.stream.request_ids)  # the caller left before the engine took them
            raise
        except BaseException:
            self._untrack(item.stream.request_ids)
            raise
        return item.stream

    def abort(self, request_ids: list[str], finish_reason: str | None = None) -> None:
        """Stop requests (no-op for finished ones). `finish_reason` replaces "abort" in metrics
        and logs when the API side ended the request on purpose (a stop string)."""
        if finish_reason is not None:
            for rid in request_ids:
                if rid in self._tracked:
                    self._tracked[rid].finish_reason_override = finish_reason
        self._post(("abort", *request_ids), 0)

    def _post(self, item, num_adds: int) -> None:
        with self._cv:
            self._inbox.append(item)
            self._pending_adds += num_adds
            self._cv.notify()

    def _untrack(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._tracked.pop(rid, None)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        finally:
            self._done.set()

    def _loop_until_stopped(self) -> None:
        reason: BaseException = EngineDeadError("the engine is shutting down")
        try:
            while self._apply(self._take_inbox()):
                if self.core.has_unfinished_requests():
                    outs = self.core.step()
                    self._publish(outs, time.monotonic())
                self._refresh_snapshot()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine; tell everyone
            log.error("engine loop failed; no more requests can be served", exc_info=exc)
            self.failure = exc
            # The client is told what happened, not our internals (the log line has them all).
            reason = EngineDeadError(f"the engine stopped on an internal error ({type(exc).__name__}); "
                                     "retry shortly")
            reason.__cause__ = exc
        with contextlib.suppress(Exception):
            self.core.shutdown()  # tensor-parallel workers, if any
        streams = set(self._routes.values())
        try:
            self._loop.call_soon_threadsafe(self._fail_all, reason, streams, self._in_hand)
        except RuntimeError:
            pass  # the loop is already closed: nobody is left to tell

    def _take_inbox(self) -> list | None:
        """Everything posted since the last step; blocks while there is nothing to do."""
        with self._cv:
            while not self._inbox and not self._stopping and not self.core.has_unfinished_requests():
                self._cv.wait()
            if self._stopping:
                return None
            items, self._inbox = self._inbox, []
            self._pending_adds = 0
            return items

    def _apply(self, items: list | None) -> bool:
        if items is None:
            return False
        self._in_hand = items  # if anything below fails, _fail_all still answers these callers
        settled: list[tuple[asyncio.Future, BaseException | None]] = []
        for item in items:
            if isinstance(item, _Add):
                settled.append((item.accepted, self._add_all(item)))
            elif item[0] == "broken":
                raise RuntimeError(f"another rank of the engine is gone: {item[1]}") from item[1]
            else:
                self._publish(self.core.abort([rid for rid in item[1:] if rid in self._routes]), time.monotonic())
        if items:
            # Before anyone hears "accepted": back-pressure must already count these requests.
            self._refresh_snapshot()
        for future, exc in settled:
            self._loop.call_soon_threadsafe(_settle, future, exc)
        self._in_hand = []
        return True

    def _add_all(self, item: _Add) -> ValueError | None:
        """Add every request of one API call, or none; the error if refused."""
        added: list[str] = []
        try:
            for r in item.requests:
                if r.request_id in self._routes:
                    raise RequestError(f"request id {r.request_id!r} is already in use")
                self.core.add_request(r.request_id, r.prompt_token_ids, r.params, r.cache_salt, item.arrival_time,
                                      grammar=r.grammar, priority=r.priority, prediction=r.prediction)
                self._routes[r.request_id] = item.stream
                added.append(r.request_id)
        except ValueError as exc:
            self.core.abort(added)
            for rid in added:
                del self._routes[rid]
            return exc
        return None

    def _publish(self, outs: list[StepOutput], now: float) -> None:
        if not outs:
            return
        batches: dict[OutputStream, list[StepOutput]] = {}
        for out in outs:
            stream = self._routes[out.request_id]
            if out.finished:
                del self._routes[out.request_id]
            batches.setdefault(stream, []).append(out)
        self._loop.call_soon_threadsafe(self._deliver, batches, now)

    def _refresh_snapshot(self) -> None:
        stats = self.core.stats
        self.snapshot = EngineSnapshot(
            num_running=self.core.num_running,
            num_waiting=self.core.num_waiting,
            kv_cache_usage=self.core.kv_cache_usage(),
            num_preemptions=stats.num_preemptions,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_computed_tokens=stats.num_computed_tokens,
            num_generated_tokens=stats.num_generated_tokens,
            spec_num_drafts=stats.spec_num_drafts,
            spec_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
            spec_accepted_per_position=tuple(stats.spec_accepted_per_position),
        )

    # -- back on the event loop -------------------------------------------------------------
    def _deliver(self, batches: dict[OutputStream, list[StepOutput]], now: float) -> None:
        for stream, outs in batches.items():
            stream._put(outs)
            for out in outs:
                self._observe(out, now)

    def _observe(self, out: StepOutput, now: float) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        if out.metrics is not None and tracked.first_scheduled_time is None:
            tracked.first_scheduled_time = out.metrics.first_scheduled_time
        if self.observer is not None:
            self.observer.on_output(tracked, out, now)
        if out.new_token_ids:
            tracked.first_token_time = tracked.first_token_time or now
            tracked.last_token_time = now
        if out.finished:
            del self._tracked[out.request_id]

    def _fail_all(self, error: EngineDeadError, streams: set[OutputStream], in_hand: list = ()) -> None:
        self.error = error
        with self._cv:
            items, self._inbox = [*in_hand, *self._inbox], []
        for item in items:
            if isinstance(item, _Add):
                _settle(item.accepted, error)
        for stream in streams:
            stream._put(error)
        self._tracked.clear()
        if self.failure is not None and self.on_dead is not None:
            self.on_dead(error)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
