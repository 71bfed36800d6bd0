"""The scheduler's waiting queue, by policy (`--scheduling-policy`, as vLLM's).

* `fcfs`: arrival order; a preempted request goes back to the front.
* `priority`: lowest `priority` value first (vLLM's convention), then arrival. Waiting ages a
  request: each `aging_s` seconds it has waited count as one priority level better, so a steady
  stream of urgent work delays a batch job by a bounded time, never for ever. The order key
  `priority + arrival / aging_s` does not change while a request waits (everyone ages alike),
  so a heap keeps it; a preempted request returns with its old key, ahead of later arrivals.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the scheduler's own queue: it holds the scheduler's requests
    from portcullis.engine.core.request import Request

PRIORITY_AGING_S = 5.0


class WaitingQueue(Protocol):
    def add(self, req: Request) -> None: ...
    def requeue(self, req: Request) -> None: ...  # a preempted request
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self):
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def requeue(self, req: Request) -> None:
        self._queue.appendleft(req)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self, aging_s: float = PRIORITY_AGING_S):
        self.aging_s = aging_s
        self._heap: list[tuple[float, int, Request]] = []
        self._removed: set[int] = set()  # ids of requests removed but still in the heap
        self._order = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority + req.arrival_time / self.aging_s, next(self._order), req))

    requeue = add  # its arrival time keeps its place

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._drop_removed()
        return heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> None:
        self._removed.add(id(req))

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][2]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[2]))

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (req for _, _, req in sorted(self._heap) if id(req) not in self._removed)


def waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
