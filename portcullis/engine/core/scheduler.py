"""Iteration-level scheduling: which requests run this step and how many tokens each computes.

Per step, within a token budget and a cap on running requests: running requests first (decodes
and unfinished prefill chunks, oldest first), then waiting requests as chunked prefills, in the
order of the scheduling policy (`waiting_queue`: FCFS, or priority with aging). When a block
cannot be allocated, a running request is preempted (FCFS: the most recently admitted; priority:
the lowest priority, latest admitted among equals): its blocks are freed and it is requeued, to
be recomputed later.

The scheduler owns every `Request`. What it tells the runner is plain data: a request the runner
has not seen (or must rebuild after a preemption) in full once, then only what changed. What the
runner produced comes back as a `ModelRunnerOutput`, which `update` applies.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from portcullis.engine.config import SchedulerConfig
from portcullis.engine.core.kv_cache import KVCacheManager
from portcullis.engine.core.output import CachedRequestData, NewRequestData, SchedulerOutput
from portcullis.engine.core.request import Request, RequestStatus
from portcullis.engine.core.spec_decode import PREDICTION_TOKENS, propose, propose_from_prediction
from portcullis.engine.core.structured_output import StructuredOutputManager
from portcullis.engine.core.waiting_queue import WaitingQueue, waiting_queue
from portcullis.engine.outputs import ModelRunnerOutput, RequestMetrics, StepOutput
from portcullis.engine.pooling import PoolingParams
from portcullis.engine.sampling_params import SamplingParams


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found cached
    num_computed_tokens: int = 0  # every token fed through the model
    num_generated_tokens: int = 0
    # Speculative decoding, named as vLLM's metrics: steps that verified proposals, proposed
    # tokens, accepted ones, and accepted ones by position (index 0: the first proposal).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 structured_output: StructuredOutputManager | None = None):
        self.kv = kv
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.structured_output = structured_output or StructuredOutputManager()
        self.policy = config.policy
        self.speculative = config.speculative
        self.waiting: WaitingQueue = waiting_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._released: list[str] = []
        # What each schedule() not yet updated ran, oldest first: (request, tokens, proposals). With
        # pipeline stages several steps are in flight; their requests wait out of the next ones.
        self._pending: deque[list[tuple[Request, int, int]]] = deque()
        self._in_flight: set[int] = set()  # id() of each Request in them (held alive by `_pending`)

    # -- requests in and out ------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams, *,
            eos_token_ids: tuple[int, ...] = (), cache_salt: str | None = None, arrival_time: float | None = None,
            structured: bool = False, priority: int = 0, prediction: list[int] | None = None) -> Request:
        """Queue a new request (the caller has validated it) in the waiting queue."""
        req = Request(
            request_id, prompt_token_ids, params, block_size=self.kv.block_size, max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids, cache_salt=cache_salt, hash_blocks=self.kv.enable_caching,
            arrival_time=arrival_time, structured=structured, priority=priority,
        )
        req.prediction = prediction
        req.spec_window = self._most_proposals(req)
        self.requests[request_id] = req
        self.waiting.add(req)
        return req

    def abort(self, request_id: str) -> StepOutput | None:
        """Finish a request as aborted; its last output, or None if it had already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return _step_output(req, [])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's plan, of requests not in a step still in flight; `update` applies what
        the runner made of it (plans are updated in the order they were made)."""
        out = SchedulerOutput()
        self._scheduled: list[tuple[Request, int, int]] = []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.num_preempted:  # memory is short: admit nothing new this step
            self._schedule_waiting(out, budget)
        if out.num_scheduled:  # an empty plan is never run: its releases wait for the next one
            out.released_ids, self._released = self._released, []
        if self.structured_output.has_requests:
            sampling = [(req, k) for req, n, k in self._scheduled
                        if req.structured and req.num_computed_tokens + n - k == req.num_tokens]
            out.grammar_ids = [req.request_id for req, _ in sampling]
            out.grammar_proposals = {c.request_id: list(c.spec_token_ids) for c in out.cached
                                     if c.spec_token_ids and c.request_id in out.grammar_ids}
        if out.num_scheduled:
            self._pending.append(self._scheduled)
            self._in_flight.update(id(req) for req, _, _ in self._scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if id(req) in self._in_flight:
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            spec, drafts = self._propose(req, budget) if n == 1 and (self.speculative or req.prediction) else ((), 0)
            k = len(spec) + drafts  # proposals to score after its last token
            new_ids = self._allocate_or_preempt(req, n + k, i, out)
            if new_ids is None:
                break
            self.kv.publish_full_blocks(req, req.num_computed_tokens + n)
            out.cached.append(CachedRequestData(req.request_id, new_ids, n + k, spec, drafts))
            self._scheduled.append((req, n + k, k))  # (request, tokens, proposals)
            budget -= n + k
            i += 1
        return budget

    def _propose(self, req: Request, budget: int) -> tuple[list[int], int]:
        """A decoding request's proposals: its prediction's, else n-gram ones, or with a draft
        model how many the runner's draft proposes (its slots are allocated now, its tokens
        drafted in the runner). Within the step's budget, never past max_tokens; under a grammar
        only the leading proposals it allows, and no draft (the runner's draft does not see it)."""
        if req.pooling:
            return [], 0
        limit = min(budget - 1, req.max_tokens - req.num_output_tokens - 1)
        free, paused = self._proposals_nearly_free(), req.spec_pause > 0
        if paused:
            req.spec_pause -= 1  # in free steps too, so that a pause does not outlive them
        if paused and not free:
            return [], 0
        if req.prediction is not None:  # a prediction the output keeps leaving costs as n-grams that fail do
            window = self._most_proposals(req) if free else req.spec_window
            spec = propose_from_prediction(req.prediction, req.output_token_ids, self.speculative, min(limit, window))
            if not spec and limit > 0:  # nothing of the prediction matches the output: look again later
                _pause(req)
        elif (cutoff := self.speculative.disable_by_batch_size) is not None and len(self.running) > cutoff:
            return [], 0
        elif self.speculative.method == "draft_model":
            return [], 0 if req.structured else max(0, min(limit, req.spec_window))
        else:
            window = self.speculative.num_speculative_tokens if free else req.spec_window
            spec = propose(req.all_token_ids, self.speculative, min(limit, window), req.packed_token_ids)
        if req.structured and spec:
            spec = self.structured_output.valid_prefix(req.request_id, spec)
        return spec, 0

    def _most_proposals(self, req: Request) -> int:
        """The most proposals `req` makes in a step: the speculative config's, or for a client's
        prediction without one, `PREDICTION_TOKENS`."""
        if self.speculative is not None:
            return self.speculative.num_speculative_tokens
        return PREDICTION_TOKENS if req.prediction is not None else 0

    def _proposals_nearly_free(self) -> bool:
        """Whether this step is small enough that scoring n-gram proposals costs about nothing:
        a forward over a few rows reads the same weights as over one (measured on the demo
        model at batch 1: a step verifying 5 proposals costs 1.05x a plain one). Then every
        request proposes its full K, ignoring the window and pause that save compute in bigger
        steps. Not for a draft model, whose every proposal costs a forward of its own."""
        spec = self.speculative  # None: a request's prediction is the only source of proposals
        return spec is not None and spec.method == "ngram" and len(self.running) * (spec.num_speculative_tokens + 1) <= FREE_ROWS

    def _allocate_or_preempt(self, req: Request, n: int, index: int, out: SchedulerOutput) -> tuple[list[int], ...] | None:
        """Blocks for `req` (running[index]), preempting from running[index:] (never a request
        already scheduled this step) until they fit; None if `req` itself had to go."""
        while (new_ids := self.kv.allocate_slots(req, n)) is None:
            victim = self._victim(index)
            self._preempt(victim, out)
            if victim is req:
                return None
        return new_ids

    def _victim(self, start: int) -> Request:
        """Never one in flight: its step still writes its blocks and will be applied."""
        candidates = [r for r in self.running[start:] if id(r) not in self._in_flight]
        if self.policy == "fcfs":
            victim = candidates[-1]  # the most recently admitted
        else:  # the highest priority value; among equals the latest admitted (max keeps the first it meets)
            victim = max(reversed(candidates), key=lambda r: r.priority)
        self.running.remove(victim)
        return victim

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.requeue(req)
        self._released.append(req.request_id)
        out.num_preempted += 1
        self.stats.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = len(hits[0]) * self.kv.block_size
            n = min(req.num_tokens - num_hit_tokens, budget)
            block_ids = self.kv.allocate_slots(req, n, hits)
            if block_ids is None:
                break
            self.waiting.pop()
            self._admit(req, num_hit_tokens)
            self.kv.publish_full_blocks(req, num_hit_tokens + n)
            out.new.append(NewRequestData(
                req.request_id, list(req.all_token_ids), req.num_prompt_tokens, req.params, req.eos_token_ids,
                block_ids, num_hit_tokens, n, len(req.prompt_logprobs),
            ))
            self._scheduled.append((req, n, 0))
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
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[StepOutput]:
        """Apply what the runner produced for `out` (entry i of `result` belongs to the i-th
        scheduled request); the outputs of the requests that got a new token."""
        scheduled = self._pending.popleft() if out.num_scheduled else []
        self._in_flight.difference_update(id(req) for req, _, _ in scheduled)
        for request_id, scored in result.prompt_logprobs.items():
            if request_id in self.requests:
                self.requests[request_id].prompt_logprobs += scored
        outputs = []
        for (req, n, k), tokens, logprobs in zip(scheduled, result.token_ids, result.logprobs):
            if req.status.finished:
                continue  # aborted while its step was in flight
            self.stats.num_computed_tokens += n
            rejected = 0
            if k:
                rejected = k - (len(tokens) - 1)  # proposals whose KV is not kept
                n -= rejected
                self._count_accepted(k, k - rejected)
                _adapt_window(req, k, k - rejected, self._most_proposals(req))
            req.num_computed_tokens += n
            if not tokens:
                continue
            first = req.num_output_tokens
            if len(tokens) == 1 and req.prediction is None:  # the common decode step
                self._append_token(req, tokens[0])
            else:
                self._append_tokens(req, tokens, k - rejected)
            if k and not req.status.finished:  # the runner trims its block table by the same rule
                self.kv.trim(req, req.num_tokens)
            taken = req.num_output_tokens - first
            step = _step_output(req, tokens if taken == len(tokens) else tokens[:taken])
            step.logprobs = None if logprobs is None else logprobs[:taken]
            if first == 0:
                step.metrics = _metrics(req)
                if req.params.prompt_logprobs is not None:
                    step.prompt_logprobs = [None, *req.prompt_logprobs]
            outputs.append(step)
        for request_id, vector in result.pooled.items():
            outputs.append(self._finish_pooling(self.requests[request_id], vector))
        return outputs

    def _finish_pooling(self, req: Request, vector) -> StepOutput:
        self.running.remove(req)
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        out = _step_output(req, [])
        out.pooled = vector
        return out

    def _append_tokens(self, req: Request, tokens: list[int], accepted: int) -> None:
        """The `accepted` proposals, then the model's own next token, until one finishes the request."""
        for i, token in enumerate(tokens):
            if req.prediction is not None and (i < accepted or _continues_prediction(req, token)):
                req.num_accepted_prediction_tokens += 1
            if self._append_token(req, token):
                break

    def _count_accepted(self, proposed: int, accepted: int) -> None:
        stats = self.stats
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += proposed
        stats.spec_num_accepted_tokens += accepted
        per_position = stats.spec_accepted_per_position
        per_position += [0] * (proposed - len(per_position))
        for j in range(accepted):
            per_position[j] += 1

    def _append_token(self, req: Request, token: int) -> bool:
        """Append one output token; whether it finished the request."""
        req.append_output_token(token)
        grammar_done = req.structured and self.structured_output.accept(req.request_id, token)
        self.stats.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        status = req.check_stop(grammar_done)
        if status is not None:
            self.running.remove(req)
            self._finish(req, status)
        return status is not None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        self.kv.free(req)
        self.structured_output.finish(req.request_id)
        self._released.append(req.request_id)
        del self.requests[req.request_id]


def _step_output(req: Request, new_tokens: list[int]) -> StepOutput:
    finished = req.status.finished
    return StepOutput(
        request_id=req.request_id,
        new_token_ids=new_tokens,
        finish_reason=req.status.value if finished else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_output_tokens=req.num_output_tokens,
        metrics=_metrics(req) if finished else None,
        num_accepted_prediction_tokens=req.num_accepted_prediction_tokens if req.prediction is not None else None,
    )


FREE_ROWS = 8  # rows a step may score while proposals count as free (_proposals_nearly_free)
MAX_SPEC_PAUSE = 32  # steps: a request that stopped matching still looks again now and then


def _adapt_window(req: Request, proposed: int, accepted: int, most: int) -> None:
    """How many proposals a request makes next: one more after a fully accepted run, one more
    than it kept after a partly accepted one, half as many after a fully rejected one, and after
    a rejected single proposal none for a pause that doubles each time (up to MAX_SPEC_PAUSE
    steps). On CPUs every scored proposal costs compute, so a request whose text does not repeat
    its context (or a client's prediction it has left) stops paying for proposals that fail."""
    if accepted == proposed:
        req.spec_window = min(most, req.spec_window + 1)
        req.spec_backoff = req.spec_pause = 0  # its text repeats again (a pause may remain from free steps)
    elif accepted:  # its match held for `accepted` tokens; proposing much further mostly scores rows that fail
        req.spec_window = min(req.spec_window, accepted + 1)
    else:
        if req.spec_window == 1:
            _pause(req)
        req.spec_window = max(1, req.spec_window // 2)


def _pause(req: Request) -> None:
    """No proposals for a while, twice as long as the last pause (up to MAX_SPEC_PAUSE steps)."""
    req.spec_backoff = min(MAX_SPEC_PAUSE, max(1, 2 * req.spec_backoff))
    req.spec_pause = req.spec_backoff


def _continues_prediction(req: Request, token: int) -> bool:
    """Whether the model's own `token` is the prediction's next while the output follows it
    (OpenAI counts such tokens, and accepted proposals, as accepted prediction tokens). Only the
    cheap check: a search of the prediction for every token was the red team's lever."""
    at, prediction = req.num_output_tokens, req.prediction
    return at < len(prediction) and prediction[at] == token and prediction[max(0, at - 8) : at] == req.output_token_ids[-8:]


def _metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time)
