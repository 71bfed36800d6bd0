"""One step's flattened model inputs: what rank 0 builds and runs, broadcasts to the
tensor-parallel workers, and each worker rebuilds from the broadcast."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from portcullis.engine.model.attention import AttentionMetadata
from portcullis.kernels import PagedBatch


@dataclass
class StepBatch:
    """One step's flattened inputs: all a tensor-parallel worker needs to follow rank 0."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows of the hidden states to turn into logits: samples, then prompt spans
    sample_idx: list[int] = field(default_factory=list)  # rank 0 only
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)  # rank 0 only

    @staticmethod
    def build(device, token_ids, positions, slots, cu, context_lens, tables, max_q, max_ctx, logit_rows, sample_idx=(), spans=()) -> StepBatch:
        """`slots` and `tables`: one per KV-cache group."""
        cu = torch.as_tensor(cu).to(device=device, dtype=torch.int32)
        context_lens = torch.as_tensor(context_lens).to(device=device, dtype=torch.int32)
        metas = [
            AttentionMetadata(
                slot_mapping=torch.as_tensor(group_slots, dtype=torch.long).to(device),
                batch=PagedBatch(cu, context_lens, torch.as_tensor(group_tables).to(device=device, dtype=torch.int32),
                                 max_query_len=max_q, max_context_len=max_ctx),
            )
            for group_slots, group_tables in zip(slots, tables)
        ]
        metas[0].other_groups = metas[1:]
        return StepBatch(
            torch.as_tensor(token_ids, dtype=torch.long).to(device),
            torch.as_tensor(positions, dtype=torch.long).to(device),
            metas[0], torch.as_tensor(list(logit_rows), dtype=torch.long).to(device),
            list(sample_idx), list(spans),
        )
