"""Tensors in, tokens out: builds one flattened batch per step, runs the model once, samples.

The runner keeps a persistent block table (one row per running request) and only copies the
blocks a step added, so preparing a step costs time in proportion to what changed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.loader import load_model
from engine.sampler import TokenLogprobs, prompt_logprobs, sample
from engine.scheduler import SchedulerOutput


@dataclass
class StepResult:
    token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.torch_device
        self.block_size = config.block_size
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
        num_blocks = budget // self.kv_bytes_per_block()
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
        input_ids, positions, meta, last_rows, sample_idx = self._prepare(out)
        hidden = self.model(input_ids, positions, meta)
        result = StepResult([None] * len(out.scheduled), [None] * len(out.scheduled))
        self._prompt_logprobs(out, hidden, meta)
        if sample_idx:
            logits = self.model.compute_logits(hidden[last_rows[sample_idx]])
            reqs = [out.scheduled[i].request for i in sample_idx]
            sampled = sample(logits, reqs, self.generator)
            for j, i in enumerate(sample_idx):
                result.token_ids[i] = sampled.token_ids[j]
                result.logprobs[i] = sampled.logprobs[j]
        return result

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata) -> None:
        """For requests that asked for prompt logprobs: score each prompt token this step reached."""
        starts = meta.cu_seqlens_q.tolist() if any(s.request.params.prompt_logprobs is not None for s in out.scheduled) else []
        for i, s in enumerate(out.scheduled):
            req, n = s.request, s.request.params.prompt_logprobs
            if n is None:
                continue
            first = max(req.num_computed_tokens, len(req.prompt_logprobs))  # already scored: skip
            last = min(req.num_computed_tokens + s.num_tokens, req.num_prompt_tokens - 1)
            if first >= last:
                continue
            rows = hidden[starts[i] + first - req.num_computed_tokens : starts[i] + last - req.num_computed_tokens]
            nxt = req.prompt_token_ids[first + 1 : last + 1]
            req.prompt_logprobs += prompt_logprobs(self.model.compute_logits(rows), nxt, n)

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

    def _prepare(self, out: SchedulerOutput):
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
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(dev),
            context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=int(query_lens.max()),
            max_context_len=max_ctx,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        last_rows = torch.from_numpy(cu[1:] - 1).to(dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta, last_rows, sample_idx
