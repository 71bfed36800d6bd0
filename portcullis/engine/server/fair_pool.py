"""A worker thread that tenants take turns on: the server's tokenizer and grammar compiler each
have one (neither is safe to share across threads, and neither may run on the event loop).

Jobs wait in one queue per tenant, and the thread serves the queues in turn, one job each: a
tenant that sends a hundred heavy prompts delays another tenant's next job by one of its jobs,
not by a hundred. What each job may cost is bounded before it is queued (prompt characters,
grammar size, the prompt-logprob product); the pool bounds the rest: how many jobs a tenant may
have waiting, how many wait in all, and how long a job may wait before it is refused with a 503
and `Retry-After`, so a client is told to come back rather than left hanging.

Everything but the job itself runs on the event loop, so the queues need no lock.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from portcullis.engine.server.errors import APIError

T = TypeVar("T")

MAX_WAIT_S = 30.0


@dataclass
class _Job:
    call: Callable[[], Any]
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)


class FairPool:
    def __init__(self, name: str, max_queued_per_tenant: int = 512, max_queued: int = 1024,
                 max_wait_s: float = MAX_WAIT_S):
        self.name = name
        self.max_queued_per_tenant = max_queued_per_tenant
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._queues: dict[str, deque[_Job]] = {}  # in turn order: the next tenant first
        self._queued = 0
        self._busy = False

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker thread, when `tenant`'s turn comes; 503 if the tenant (or
        everyone) already has as many jobs waiting as allowed."""
        queue = self._queues.get(tenant, ())
        if len(queue) >= self.max_queued_per_tenant or self._queued >= self.max_queued:
            raise self._overloaded("too many of this tenant's requests are being prepared"
                                   if queue else "too many requests are being prepared")
        job = _Job(functools.partial(fn, *args), asyncio.get_running_loop().create_future())
        self._queues.setdefault(tenant, deque()).append(job)
        self._queued += 1
        self._start_next()
        return await job.future

    @property
    def queued(self) -> int:
        return self._queued

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start_next(self) -> None:
        while not self._busy and self._queues:
            tenant, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            self._queued -= 1
            del self._queues[tenant]
            if queue:  # the tenant's next job goes behind every other tenant's
                self._queues[tenant] = queue
            if job.future.done():  # its caller gave up (a client that hung up)
                continue
            if time.monotonic() - job.queued_at > self.max_wait_s:
                job.future.set_exception(self._overloaded("the request waited too long to be prepared"))
                continue
            self._busy = True
            running = asyncio.get_running_loop().run_in_executor(self._executor, job.call)
            running.add_done_callback(functools.partial(self._finished, job))

    def _finished(self, job: _Job, running: asyncio.Future) -> None:
        self._busy = False
        error = None if running.cancelled() else running.exception()  # read even if no one waits
        if not job.future.done():
            if running.cancelled():
                job.future.cancel()
            elif error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(running.result())
        self._start_next()

    def _overloaded(self, why: str) -> APIError:
        return APIError(503, f"the engine is overloaded: {why}; retry shortly", code="overloaded",
                        headers={"Retry-After": "1"})
