"""Tensors in, tokens out: builds one flattened batch per step, runs the model once, samples.

The runner keeps a persistent block table (one row per running request) and only copies the
blocks a step added, so preparing a step costs time in proportion to what changed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.distributed import agree_on_min
from engine.loader import load_model
from engine.sampler import TokenLogprobs, prompt_logprobs, sample
from engine.scheduler import SchedulerOutput
from engine.step_batch import StepBatch


@dataclass
class StepResult:
    token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]


class ModelRunner:
    """On rank 0 it prepares each step, hands the batch to `broadcast` (the tensor-parallel
    workers' `send_step`, when there are any), runs the model and samples; on the other ranks a
    worker only calls `forward` on what rank 0 broadcast. Build it after this process's TP rank
    is set: its layers shard themselves as they are constructed."""

    def __init__(self, config: EngineConfig, broadcast: Callable[[StepBatch], None] | None = None):
        self.config = config
        self.device = config.torch_device
        self.block_size = config.block_size
        self.broadcast = broadcast
        self.model = load_model(config.model_path, config.hf_config, config.torch_dtype, self.device, config.max_model_len)
        self.num_blocks = self._allocate_kv_cache()
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.block_table = np.zeros((config.max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.rows: dict[str, int] = {}  # request id -> its row in block_table
        self.row_len = np.zeros(config.max_num_seqs, dtype=np.int64)
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.generator = torch.Generator().manual_seed(config.seed)

    # -- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        layer = self.model.attention_layers()[0]
        elem = torch.empty((), dtype=self.config.torch_dtype).element_size()
        per_layer = 2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem
        return per_layer * len(self.model.attention_layers())

    def _kv_cache_budget(self) -> int:
        """Bytes for the KV cache: `kv_cache_memory` when given (always on CPU), else on a GPU
        what `gpu_memory_utilization` leaves after a peak forward pass of a full token budget."""
        if self.config.kv_cache_memory is not None or self.device.type != "cuda":
            return self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - torch.cuda.max_memory_allocated(self.device)
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
            )
        return budget

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """One forward pass of a full token budget, with scratch caches, to measure peak activations."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        blocks = -(-n // self.block_size)
        for layer in self.model.attention_layers():
            shape = (blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = (torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device),) * 2
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device).unsqueeze(0),
            max_query_len=n, max_context_len=n,
        )
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), meta)
        self.model.compute_logits(hidden[-1:])
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _allocate_kv_cache(self) -> int:
        budget = self._kv_cache_budget()
        num_blocks = agree_on_min(budget // self.kv_bytes_per_block(), self.device)
        if num_blocks < 1:
            raise ValueError(
                f"the KV-cache budget ({budget} bytes) is smaller than one KV block "
                f"({self.kv_bytes_per_block()} bytes); raise it"
            )
        for layer in self.model.attention_layers():
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            # Zeroed, not empty: a never-written slot must not hold NaN that masking cannot undo.
            k = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
            layer.kv_cache = (k, torch.zeros_like(k))
        return num_blocks

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step; entry i of the result belongs to `out.scheduled[i]` (None: a prefill
        chunk that has not reached the end of its prompt samples nothing)."""
        self._update_block_table(out)
        batch = self._prepare(out)
        if self.broadcast is not None:
            self.broadcast(batch)
        logits = self.forward(batch)
        result = StepResult([None] * len(out.scheduled), [None] * len(out.scheduled))
        n_sample = len(batch.sample_idx)
        if n_sample:
            reqs = [out.scheduled[i].request for i in batch.sample_idx]
            sampled = sample(logits[:n_sample], reqs, self.generator)
            for j, i in enumerate(batch.sample_idx):
                result.token_ids[i] = sampled.token_ids[j]
                result.logprobs[i] = sampled.logprobs[j]
        self._record_prompt_logprobs(out, batch, logits[n_sample:] if logits is not None else None)
        return result

    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The model on one batch; logits only for `batch.logit_rows` (every rank runs this)."""
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        if len(batch.logit_rows) == 0:
            return None
        return self.model.compute_logits(hidden[batch.logit_rows])

    def _record_prompt_logprobs(self, out: SchedulerOutput, batch: StepBatch, logits: torch.Tensor | None) -> None:
        offset = 0
        for i, first, last in batch.prompt_spans:
            req = out.scheduled[i].request
            rows = logits[offset : offset + last - first]
            offset += last - first
            nxt = req.prompt_token_ids[first + 1 : last + 1]
            req.prompt_logprobs += prompt_logprobs(rows, nxt, req.params.prompt_logprobs)

    def _update_block_table(self, out: SchedulerOutput) -> None:
        for req_id in out.released_ids:
            row = self.rows.pop(req_id, None)
            if row is not None:
                self.free_rows.append(row)
        for s in out.scheduled:
            req_id = s.request.request_id
            if s.is_new and req_id not in self.rows:
                self.rows[req_id] = self.free_rows.pop()
                self.row_len[self.rows[req_id]] = 0
            row = self.rows[req_id]
            if s.new_block_ids:
                n = int(self.row_len[row])
                self.block_table[row, n : n + len(s.new_block_ids)] = s.new_block_ids
                self.row_len[row] = n + len(s.new_block_ids)

    def _prepare(self, out: SchedulerOutput) -> StepBatch:
        num_seqs = len(out.scheduled)
        starts = np.empty(num_seqs, dtype=np.int64)
        query_lens = np.empty(num_seqs, dtype=np.int64)
        rows = np.empty(num_seqs, dtype=np.int64)
        token_ids: list[int] = []
        sample_idx = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            start = req.num_computed_tokens
            starts[i], query_lens[i], rows[i] = start, s.num_tokens, self.rows[req.request_id]
            token_ids += req.all_token_ids[start : start + s.num_tokens]
            if start + s.num_tokens == req.num_tokens:
                sample_idx.append(i)
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        total = int(cu[-1])
        positions = np.repeat(starts - cu[:-1], query_lens) + np.arange(total)
        row_of_token = np.repeat(rows, query_lens)
        bs = self.block_size
        slots = self.block_table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        context_lens = starts + query_lens
        max_ctx = int(context_lens.max())
        tables = self.block_table[rows, : -(-max_ctx // bs)]
        spans = _prompt_logprob_spans(out)
        logit_rows = [int(cu[i + 1]) - 1 for i in sample_idx]
        for i, first, last in spans:
            base = int(cu[i]) - out.scheduled[i].request.num_computed_tokens
            logit_rows += range(base + first, base + last)
        return StepBatch.build(
            self.device, token_ids, positions, slots, cu, context_lens, tables,
            int(query_lens.max()), max_ctx, logit_rows, sample_idx, spans,
        )


def _prompt_logprob_spans(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    """(scheduled index, first, last): the prompt positions whose next token gets scored this step."""
    spans = []
    for i, s in enumerate(out.scheduled):
        req = s.request
        if req.params.prompt_logprobs is None:
            continue
        first = max(req.num_computed_tokens, len(req.prompt_logprobs))  # after a preemption: no repeats
        last = min(req.num_computed_tokens + s.num_tokens, req.num_prompt_tokens - 1)
        if first < last:
            spans.append((i, first, last))
    return spans
