"""The runner's own view of the requests it runs, built only from the scheduler's plain output
(`NewRequestData` once, then `CachedRequestData`): a row each in a persistent block table, their
tokens and the parameters sampling needs. Each step it flattens the scheduled rows into a
`StepBatch` and one `BatchSamplingArgs`, at a cost that follows what changed, not what is held.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from portcullis.engine.core.output import GrammarOutput, SchedulerOutput
from portcullis.engine.pooling import PoolingParams
from portcullis.engine.sampling_params import SamplingParams
from portcullis.engine.worker.sampler import BatchSamplingArgs
from portcullis.engine.worker.step_batch import StepBatch


@dataclass(eq=False, slots=True)
class RunnerRequest:
    """One request as the runner holds it, from its admission until the scheduler releases it."""

    request_id: str
    row: int  # its row in the block table
    token_ids: list[int]  # prompt, then outputs: the runner appends what it samples
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_prompt_logprobs: int  # prompt positions scored so far
    prompt_ids: torch.Tensor | None = None  # distinct prompt ids, made on first use (penalties)
    pooling: bool = False  # an embedding: pooled, not sampled, when its last chunk is computed
    pool_first: torch.Tensor | None = None  # its first position's hidden state (CLS pooling)
    pool_sum: torch.Tensor | None = None  # the sum of its hidden states so far (mean pooling)
    spec: list[int] = ()  # this step's proposals, computed after its last token (speculative decoding)
    num_draft: int = 0  # of which the draft model proposes this many this step (their slots are allocated)
    draft_computed: int = 0  # tokens whose draft-model KV is in the cache (method draft_model)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def samples_after(self, num_tokens: int) -> bool:
        """Whether computing `num_tokens` more (proposals included) reaches the end of its tokens
        (new ones are sampled: one per position from its last token on)."""
        return self.num_computed_tokens + num_tokens == len(self.token_ids) + len(self.spec)


Scheduled = list[tuple[RunnerRequest, int]]  # one step's requests in batch order, with their token counts


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 num_kv_groups: int = 1):
        self.block_size = block_size
        self.device = device
        # One table per KV-cache group; a row's tables are all `row_len` long (a sliding group's
        # freed blocks stay in its table, outside the window the kernels read).
        self.block_tables = [np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32) for _ in range(num_kv_groups)]
        self.row_len = np.zeros(max_num_seqs, dtype=np.int64)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, RunnerRequest] = {}

    def update(self, out: SchedulerOutput) -> Scheduled:
        """Drop released requests, take new ones, append new blocks; the step's requests in order."""
        for request_id in out.released_ids:
            req = self.requests.pop(request_id, None)
            if req is not None:
                self.free_rows.append(req.row)
        scheduled = []
        for c in out.cached:
            req = self.requests[c.request_id]
            req.spec, req.num_draft = c.spec_token_ids, c.num_draft_tokens
            self._append_blocks(req.row, c.new_block_ids)
            scheduled.append((req, c.num_tokens))
        for n in out.new:
            req = RunnerRequest(n.request_id, self.free_rows.pop(), n.token_ids, n.num_prompt_tokens, n.params,
                                n.eos_token_ids, n.num_computed_tokens, n.num_prompt_logprobs,
                                pooling=isinstance(n.params, PoolingParams), draft_computed=n.num_computed_tokens)
            self.requests[n.request_id] = req
            self.row_len[req.row] = 0
            self._append_blocks(req.row, n.block_ids)
            scheduled.append((req, n.num_tokens))
        return scheduled

    def _append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        if block_ids and block_ids[0]:
            n, k = int(self.row_len[row]), len(block_ids[0])
            for table, ids in zip(self.block_tables, block_ids):
                table[row, n : n + k] = ids
            self.row_len[row] = n + k

    def prepare(self, scheduled: Scheduled) -> StepBatch:
        num_seqs = len(scheduled)
        starts = np.empty(num_seqs, dtype=np.int64)
        query_lens = np.empty(num_seqs, dtype=np.int64)
        rows = np.empty(num_seqs, dtype=np.int64)
        token_ids: list[int] = []
        sample_idx = []
        speculating = False
        for i, (req, n) in enumerate(scheduled):
            start = req.num_computed_tokens
            starts[i], query_lens[i], rows[i] = start, n, req.row
            if req.spec:
                speculating = True
                token_ids += req.token_ids[start:]
                token_ids += req.spec
            else:
                token_ids += req.token_ids[start : start + n]
            if req.samples_after(n) and not req.pooling:
                sample_idx.append(i)
        cu = _cumulative(query_lens)
        spans = _prompt_logprob_spans(scheduled)
        if speculating:  # every proposal's position is scored, and the one after the last
            logit_rows = [r for i in sample_idx for r in range(int(cu[i + 1]) - 1 - len(scheduled[i][0].spec), int(cu[i + 1]))]
        else:
            logit_rows = [int(cu[i + 1]) - 1 for i in sample_idx]
        for i, first, last in spans:
            base = int(cu[i]) - scheduled[i][0].num_computed_tokens
            logit_rows += range(base + first, base + last)
        return self._build(rows, starts, query_lens, cu, token_ids, logit_rows, sample_idx, spans)

    def _build(self, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray, cu: np.ndarray,
               token_ids: list[int], logit_rows: list[int], sample_idx=(), spans=()) -> StepBatch:
        """The batch of sequences in block-table `rows`, each computing `query_lens` tokens from
        position `starts` (`cu`: the cumulative query lengths)."""
        positions = np.repeat(starts - cu[:-1], query_lens) + np.arange(int(cu[-1]))
        row_of_token = np.repeat(rows, query_lens)
        bs = self.block_size
        blocks, offsets = positions // bs, positions % bs
        slots = [table[row_of_token, blocks].astype(np.int64) * bs + offsets for table in self.block_tables]
        context_lens = starts + query_lens
        max_ctx = int(context_lens.max())
        tables = [table[rows, : -(-max_ctx // bs)] for table in self.block_tables]
        return StepBatch.build(
            self.device, token_ids, positions, slots, cu, context_lens, tables,
            int(query_lens.max()), max_ctx, logit_rows, sample_idx, spans,
        )

    # -- the draft model's batches (speculative method draft_model) ---------------------------------
    # Its KV cache uses the target's block ids and slots, so its KV mirrors the target's slot by
    # slot: each step it computes what the target computes, before the target does, except the
    # last proposal of a run (drafted, never fed back): the next step's catch-up computes it when
    # it was accepted. Prefix-cache hits, preemption and freeing then need nothing of their own.
    def prepare_draft(self, scheduled: Scheduled) -> tuple[StepBatch | None, list[RunnerRequest]]:
        """The draft's catch-up forward: each request's tokens without draft KV up to what the
        target computes this step before any proposal. Its logit rows are the last positions of
        the requests that draft (`num_draft`), returned in that order; None when nothing is missing."""
        todo = [(req, req.draft_computed, req.num_computed_tokens + n - len(req.spec) - req.num_draft)
                for req, n in scheduled if not req.pooling]
        todo = [t for t in todo if t[1] < t[2]]
        if not todo:
            return None, []
        starts = np.array([start for _, start, _ in todo], dtype=np.int64)
        query_lens = np.array([end for _, _, end in todo], dtype=np.int64) - starts
        cu = _cumulative(query_lens)
        token_ids = [t for req, start, end in todo for t in req.token_ids[start:end]]
        drafting = [i for i, (req, _, _) in enumerate(todo) if req.num_draft]
        for req, _, end in todo:
            req.draft_computed = end
        rows = np.array([req.row for req, _, _ in todo], dtype=np.int64)
        logit_rows = [int(cu[i + 1]) - 1 for i in drafting]
        return self._build(rows, starts, query_lens, cu, token_ids, logit_rows), [todo[i][0] for i in drafting]

    def prepare_draft_step(self, reqs: list[RunnerRequest]) -> StepBatch:
        """One token each: the latest proposal in `req.spec`, whose draft logits give the next."""
        starts = np.array([req.num_computed_tokens + len(req.spec) for req in reqs], dtype=np.int64)
        for req, start in zip(reqs, starts):
            req.draft_computed = int(start) + 1
        ones = np.ones(len(reqs), dtype=np.int64)
        rows = np.array([req.row for req in reqs], dtype=np.int64)
        return self._build(rows, starts, ones, _cumulative(ones), [req.spec[-1] for req in reqs], list(range(len(reqs))))

    def sampling_args(self, reqs: list[RunnerRequest], grammar: GrammarOutput | None, vocab: int) -> BatchSamplingArgs:
        """The sampling inputs of `reqs`, the requests that sample this step, in order: one row
        each, or with proposals one per position, as if the proposals before it were accepted."""
        for req in reqs:
            if req.params.uses_penalties and req.prompt_ids is None:
                req.prompt_ids = BatchSamplingArgs.distinct_ids(req.token_ids[: req.num_prompt_tokens], vocab)
        rows = [(req, j) for req in reqs for j in range(len(req.spec) + 1)]
        args = BatchSamplingArgs(
            params=[req.params for req, _ in rows],
            num_outputs=[req.num_outputs + j for req, j in rows],
            eos_token_ids=[req.eos_token_ids for req, _ in rows],
            output_token_ids=[req.token_ids[req.num_prompt_tokens :] + list(req.spec[:j])
                              if req.params.uses_penalties else None for req, j in rows],
            prompt_ids=[req.prompt_ids for req, _ in rows],
        )
        if grammar is not None:
            first_row = {}
            for i, (req, _) in enumerate(rows):
                first_row.setdefault(req.request_id, i)
            args.bitmask_rows = [first_row[rid] + j for rid, j in zip(grammar.request_ids, grammar.positions)]
            args.bitmask = grammar.bitmask
        return args

    def advance(self, scheduled: Scheduled, token_ids: list[list[int]]) -> None:
        """After the step: the computed tokens count (rejected proposals' KV is not kept), and
        the new tokens join their request. After proposals, blocks past those its tokens fill
        leave its table, as the scheduler frees them (`KVCacheManager.trim`)."""
        for (req, n), tokens in zip(scheduled, token_ids):
            if self.requests.get(req.request_id) is not req:
                continue  # released while its step was in flight (aborted): its row may be another's now
            req.num_computed_tokens += n
            req.token_ids += tokens
            if req.spec:
                req.num_computed_tokens -= len(req.spec) - (len(tokens) - 1)  # the rejected ones
                req.spec = ()
                filled = -(-len(req.token_ids) // self.block_size)
                self.row_len[req.row] = min(int(self.row_len[req.row]), filled)
            # Draft KV past the accepted tokens is of rejected proposals: to be overwritten.
            req.draft_computed = min(req.draft_computed, req.num_computed_tokens)


def _cumulative(query_lens: np.ndarray) -> np.ndarray:
    """[0, q0, q0 + q1, ...]: where each sequence's query rows start, then the total."""
    cu = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    return cu


def _prompt_logprob_spans(scheduled: Scheduled) -> list[tuple[int, int, int]]:
    """(scheduled index, first, last): the prompt positions whose next token gets scored this step."""
    spans = []
    for i, (req, n) in enumerate(scheduled):
        if req.pooling or req.params.prompt_logprobs is None:
            continue
        first = max(req.num_computed_tokens, req.num_prompt_logprobs)  # after a preemption: no repeats
        last = min(req.num_computed_tokens + n, req.num_prompt_tokens - 1)
        if first < last:
            spans.append((i, first, last))
    return spans
