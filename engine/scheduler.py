"""Iteration-level scheduling: which requests run this step and how many tokens each computes.

Per step, within a token budget and a cap on running requests: running requests first (decodes
and unfinished prefill chunks, oldest first), then waiting requests FCFS as chunked prefills.
When a block cannot be allocated, the most recently admitted running request is preempted: its
blocks are freed and it is requeued at the front, to be recomputed later.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step
    new_block_ids: list[int]  # blocks appended to its block table this step
    is_new: bool  # its block table starts afresh (first admission or resumption after preemption)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    released_ids: list[str] = field(default_factory=list)  # requests whose rows the runner may drop
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found cached
    num_computed_tokens: int = 0  # every token fed through the model
    num_generated_tokens: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._released: list[str] = []

    # -- requests in and out ------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(released_ids=self._released)
        self._released = []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.num_preempted:  # memory is short: admit nothing new this step
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_ids = self._allocate_or_preempt(req, n, out)
            if new_ids is None:
                break
            self.kv.publish_full_blocks(req, req.num_computed_tokens + n)
            out.scheduled.append(ScheduledRequest(req, n, new_ids, is_new=False))
            budget -= n
            i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> list[int] | None:
        while (new_ids := self.kv.allocate_slots(req, n)) is None:
            victim = self.running.pop()  # the most recently admitted; never one already scheduled
            self._preempt(victim, out)
            if victim is req:
                return None
        return new_ids

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self._released.append(req.request_id)
        out.num_preempted += 1
        self.stats.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = len(hits) * self.kv.block_size
            n = min(req.num_tokens - num_hit_tokens, budget)
            new_ids = self.kv.allocate_slots(req, n, hits)
            if new_ids is None:
                break
            self.waiting.popleft()
            self._admit(req, num_hit_tokens)
            self.kv.publish_full_blocks(req, num_hit_tokens + n)
            out.scheduled.append(ScheduledRequest(req, n, new_ids, is_new=True))
            budget -= n

    def _admit(self, req: Request, num_hit_tokens: int) -> None:
        if req.num_cached_tokens < 0:  # first admission: this is what the prefix cache saved
            req.num_cached_tokens = num_hit_tokens
            req.first_scheduled_time = time.monotonic()
            self.stats.prefix_cache_queries += req.num_prompt_tokens
            self.stats.prefix_cache_hits += num_hit_tokens
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    # -- after the forward pass -----------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> None:
        """Advance each scheduled request; `sampled[i]` is the new token of `out.scheduled[i]`, or
        None for a prefill chunk that has not reached the end of its prompt."""
        for sched, token in zip(out.scheduled, sampled):
            req = sched.request
            req.num_computed_tokens += sched.num_tokens
            self.stats.num_computed_tokens += sched.num_tokens
            if token is not None:
                self._append_token(req, token)

    def _append_token(self, req: Request, token: int) -> None:
        req.append_output_token(token)
        if req.matcher is not None:
            req.matcher.accept_token(token)
        self.stats.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        status = req.check_stop()
        if status is not None:
            self.running.remove(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        self.kv.free(req)
        self._released.append(req.request_id)
        del self.requests[req.request_id]
