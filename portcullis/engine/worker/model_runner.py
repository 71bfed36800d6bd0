"""Tensors in, tokens out: builds one flattened batch per step, runs the model once, samples.

The runner never sees a `Request`: it keeps its own state of each request it runs (`InputBatch`,
a persistent block table to which a step only adds its new blocks) from the scheduler's plain
output, and returns what it produced as a `ModelRunnerOutput` for the scheduler to apply.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from portcullis.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from portcullis.engine.core.output import GrammarOutput, SchedulerOutput
from portcullis.engine.distributed import (
    agree_on_min,
    is_first_stage,
    is_last_stage,
    pp_size,
    receive_from_previous_stage,
    receive_logits,
    send_logits,
    send_to_next_stage,
    tp_rank,
)
from portcullis.engine.model.attention import AttentionMetadata
from portcullis.engine.model.loader import load_model
from portcullis.engine.outputs import ModelRunnerOutput
from portcullis.engine.worker.input_batch import InputBatch, Scheduled
from portcullis.engine.worker.pooler import pool
from portcullis.engine.worker.sampler import TokenLogprobs, prompt_logprobs, sample
from portcullis.engine.worker.step_batch import StepBatch
from portcullis.kernels import allocate_kv_cache


@dataclass
class SubmittedStep:
    """A step `ModelRunner.submit` started and `collect` finishes."""

    scheduled: Scheduled
    batch: StepBatch
    grammar: GrammarOutput | None
    hidden: torch.Tensor
    logits: torch.Tensor | None  # None until collected when a later stage computes them


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
        self.pooling = config.pooling  # set: an embedding runner, whose model has no LM head
        self.model = load_model(config.model_path, config.hf_config, config.torch_dtype, self.device,
                                config.max_model_len, lm_head=self.pooling is None,
                                gguf_dequantize=config.gguf_dequantize, gguf_activations=config.gguf_activations)
        # Speculative method draft_model: the proposer, its KV cache in the target's blocks (input_batch).
        self.draft = None if config.draft_model_path is None else load_model(
            config.draft_model_path, config.draft_hf_config, config.torch_dtype, self.device, config.max_model_len,
            gguf_dequantize=config.gguf_dequantize, gguf_activations=config.gguf_activations)
        self.kv_groups = self._kv_cache_groups()
        self.num_blocks = self._allocate_kv_cache()
        max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.input_batch = InputBatch(config.max_num_seqs, max_blocks_per_seq, self.block_size, self.device,
                                      len(self.kv_groups))
        self.generator = torch.Generator().manual_seed(config.seed)

    # -- KV cache ------------------------------------------------------------------------------
    def _attention_layers(self) -> list:
        """Every layer with a KV cache: the target's, then the draft model's (same blocks)."""
        return self.model.attention_layers() + (self.draft.attention_layers() if self.draft is not None else [])

    def _kv_cache_groups(self) -> list[tuple[int | None, list]]:
        """(sliding window or None, layers) of each KV-cache group (see `KVCacheManager`). One group
        when every layer has one window (a window no shorter than `max_model_len` frees nothing:
        full attention); with sliding-window and full-attention layers mixed, one group per `n`
        layers of a window, `n` the fewest layers of any window, so that a block id stands for the
        same bytes in every group (vLLM's hybrid KV cache). A draft model shares the target's
        block ids and computes its KV in the same slots, so with one every layer keeps every
        block; so do mixed layers of several shapes (one full-attention group)."""
        layers = self._attention_layers()
        if self.draft is not None:
            return [(None, layers)]
        by_window: dict[int | None, list] = {}
        for layer in layers:
            window = layer.sliding_window
            by_window.setdefault(window if window is not None and window < self.config.max_model_len else None, []).append(layer)
        if pp_size() > 1:  # rank 0's block tables serve every stage: one group, alike on all
            return [(self._window_of_every_stage(by_window), layers)]
        if len(by_window) == 1:
            return list(by_window.items())
        if len({(layer.num_kv_heads, layer.head_dim) for layer in layers}) > 1:
            return [(None, layers)]
        n = min(len(kind) for kind in by_window.values())
        return [(window, kind[i : i + n]) for window, kind in by_window.items() for i in range(0, len(kind), n)]

    def _window_of_every_stage(self, by_window: dict[int | None, list]) -> int | None:
        """The one window every layer of every stage has, else None (full attention: each
        layer still masks its own window, only the freeing of blocks outside it is lost)."""
        full = self.config.max_model_len
        mine = next(iter(by_window)) if len(by_window) == 1 else None
        value = full if mine is None else mine
        low, high = agree_on_min(value, self.device), -agree_on_min(-value, self.device)
        return None if low != high or low == full else low

    @property
    def kv_sliding_windows(self) -> tuple[int | None, ...]:
        """Each KV-cache group's sliding window (None: full attention), for the `KVCacheManager`."""
        return tuple(window for window, _ in self.kv_groups)

    def _kv_slots(self) -> list:
        """The layers of the largest group: each has a K and a V tensor of its own, which the
        layer of that index in every other group shares."""
        return max((layers for _, layers in self.kv_groups), key=len)

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.config.torch_kv_cache_dtype).element_size()
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem for layer in self._kv_slots())

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
        from portcullis.kernels import PagedBatch

        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        blocks = -(-n // self.block_size)
        for layer in self.model.attention_layers():
            shape = (blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = (torch.zeros(shape, dtype=self.config.torch_kv_cache_dtype, device=self.device),) * 2
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            batch=PagedBatch(
                cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
                context_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
                block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device).unsqueeze(0),
                max_query_len=n, max_context_len=n,
            ),
        )
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        previous = None if is_first_stage() else torch.zeros(
            n, self.config.hf_config.hidden_size, dtype=self.config.torch_dtype, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), meta, previous)
        if is_last_stage():
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
        dtype = self.config.torch_kv_cache_dtype
        for i, slot in enumerate(self._kv_slots()):
            shape = (num_blocks, self.block_size, slot.num_kv_heads, slot.head_dim)
            cache = (allocate_kv_cache(shape, dtype, self.device), allocate_kv_cache(shape, dtype, self.device))
            for group, (_, layers) in enumerate(self.kv_groups):
                if i < len(layers):
                    layers[i].kv_cache, layers[i].kv_group = cache, group
        return num_blocks

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Run one step of `out`; `grammar` constrains the structured requests that sample in it."""
        return self.collect(self.submit(out, grammar))

    @torch.inference_mode()
    def submit(self, out: SchedulerOutput, grammar: GrammarOutput | None = None) -> SubmittedStep:
        """A step up to its logits: with pipeline stages, rank 0 runs the first and hands the step
        on, and `collect` later takes the last stage's logits, so steps of other requests can be
        submitted meanwhile (`EngineCore`'s batch queue)."""
        scheduled = self.input_batch.update(out)
        if self.draft is not None:
            self._draft_proposals(scheduled)
        batch = self.input_batch.prepare(scheduled)
        if self.broadcast is not None:
            self.broadcast(batch)
        hidden, logits = self.forward(batch)
        return SubmittedStep(scheduled, batch, grammar, hidden, logits)

    @torch.inference_mode()
    def collect(self, step: SubmittedStep) -> ModelRunnerOutput:
        """Sample the submitted step (rank 0), and advance its requests."""
        scheduled, batch, logits = step.scheduled, step.batch, step.logits
        if logits is None and len(batch.logit_rows):  # the last stage computed them
            logits = receive_logits(len(batch.logit_rows), self.config.hf_config.vocab_size, self.config.torch_dtype,
                                    self.device)
        result = ModelRunnerOutput([[] for _ in scheduled], [None] * len(scheduled))
        if self.pooling is not None:
            result.pooled = self._pool(scheduled, step.hidden)
        n_rows = 0
        if batch.sample_idx:
            reqs = [scheduled[i][0] for i in batch.sample_idx]
            args = self.input_batch.sampling_args(reqs, step.grammar, logits.shape[-1])
            n_rows = len(args.params)
            sampled = sample(logits[:n_rows], args, self.generator)
            row = 0
            for i, req in zip(batch.sample_idx, reqs):
                tokens = sampled.token_ids[row : row + len(req.spec) + 1]
                kept = _accepted(req.spec, tokens) + 1
                result.token_ids[i] = tokens[:kept]
                if req.params.logprobs is not None:
                    result.logprobs[i] = sampled.logprobs[row : row + kept]
                row += len(req.spec) + 1
        if batch.prompt_spans:
            result.prompt_logprobs = _score_prompts(scheduled, batch, logits[n_rows:])
        self.input_batch.advance(scheduled, result.token_ids)
        return result

    def _draft_proposals(self, scheduled: Scheduled) -> None:
        """The draft model's greedy proposals, into `spec` of each request given draft slots: one
        forward computes the draft KV it lacks (up to each request's last token) and gives every
        first proposal, then one one-token forward per further proposal. Greedy: a proposal that
        is a function of the context leaves verification exact at any temperature."""
        batch, drafting = self.input_batch.prepare_draft(scheduled)
        if batch is None:
            return
        for req, token in zip(drafting, self._draft_argmax(batch)):
            req.spec = [token]
        for j in range(1, max((req.num_draft for req in drafting), default=0)):
            drafting = [req for req in drafting if req.num_draft > j]
            for req, token in zip(drafting, self._draft_argmax(self.input_batch.prepare_draft_step(drafting))):
                req.spec.append(token)

    def _draft_argmax(self, batch: StepBatch) -> list[int]:
        hidden = self.draft(batch.input_ids, batch.positions, batch.meta)
        if len(batch.logit_rows) == 0:
            return []
        return self.draft.compute_logits(hidden[batch.logit_rows]).argmax(-1).tolist()

    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model on one batch: its final hidden states, and logits only for
        `batch.logit_rows` (every rank runs this). Over pipeline stages each takes the previous
        stage's hidden states and hands the step and its own on; the last stage sends the logits
        to rank 0 (`collect` takes them there), so before the last stage they are None."""
        rows = len(batch.logit_rows)
        hidden = None if is_first_stage() else receive_from_previous_stage(
            (len(batch.input_ids), self.config.hf_config.hidden_size), self.config.torch_dtype, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, hidden)
        if not is_last_stage():
            send_to_next_stage(*batch.to_wire(), hidden)
            return hidden, None
        if rows == 0:
            return hidden, None
        logits = self.model.compute_logits(hidden[batch.logit_rows])
        if not is_first_stage() and tp_rank() == 0:
            send_logits(logits.to(self.config.torch_dtype))
        return hidden, logits

    def _pool(self, scheduled: Scheduled, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keep what pooling needs of each request's rows; the embeddings of those that finished."""
        pooled, row = {}, 0
        mean = self.pooling.pooling_type == "mean"
        for req, n in scheduled:
            rows = hidden[row : row + n].float()
            row += n
            if req.num_computed_tokens == 0:
                req.pool_first = rows[0]
            if mean:
                req.pool_sum = rows.sum(0) if req.pool_sum is None else req.pool_sum + rows.sum(0)
            if req.samples_after(n):
                pooled[req.request_id] = pool(self.pooling, req.params, req.pool_first, req.pool_sum, rows[-1],
                                              len(req.token_ids)).cpu()
        return pooled


def _accepted(proposals: list[int], tokens: list[int]) -> int:
    """How many proposals the model agrees with: tokens[j] is what it draws after the first j
    proposals, so proposal j stands while it equals tokens[j] (see `engine.spec_decode`)."""
    for j, proposal in enumerate(proposals):
        if tokens[j] != proposal:
            return j
    return len(proposals)


def _score_prompts(scheduled: Scheduled, batch: StepBatch, logits: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
    """Logprobs of the prompt positions in `batch.prompt_spans`, by request id."""
    scored = {}
    offset = 0
    for i, first, last in batch.prompt_spans:
        req = scheduled[i][0]
        rows = logits[offset : offset + last - first]
        offset += last - first
        scored[req.request_id] = prompt_logprobs(rows, req.token_ids[first + 1 : last + 1], req.params.prompt_logprobs)
        req.num_prompt_logprobs = last
    return scored
