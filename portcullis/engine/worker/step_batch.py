"""One step's flattened model inputs: what rank 0 builds and runs, broadcasts to its stage's
tensor-parallel workers (each stage hands them on to the next with its hidden states), and each
worker rebuilds from what it received: a header of `HEADER` ints, then one payload of ints."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from portcullis.engine.model.attention import AttentionMetadata
from portcullis.kernels import PagedBatch

STOP, STEP, HEARTBEAT = 0, 1, 2  # a header's command (a heartbeat keeps idle ranks inside their timeout)
HEADER = 8  # ints: command, tokens, sequences, block-table columns, logit rows, max query, max context, other groups


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

    def to_wire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The header and payload (int64) a worker rebuilds this batch from (`from_wire`)."""
        m = self.meta.batch
        others = self.meta.other_groups  # KV-cache groups past the first: their slots and tables follow
        header = torch.tensor([STEP, len(self.input_ids), len(m.cu_seqlens_q) - 1, m.block_tables.shape[1],
                               len(self.logit_rows), m.max_query_len, m.max_context_len, len(others)],
                              dtype=torch.long, device=self.input_ids.device)
        payload = torch.cat([
            self.input_ids, self.positions, self.meta.slot_mapping, m.cu_seqlens_q.long(), m.context_lens.long(),
            m.block_tables.long().flatten(), self.logit_rows,
            *(t for g in others for t in (g.slot_mapping, g.batch.block_tables.long().flatten())),
        ])
        return header, payload

    @staticmethod
    def payload_size(header: list[int]) -> int:
        _, tokens, seqs, cols, rows, _, _, num_other_groups = header
        return 3 * tokens + 2 * seqs + 1 + seqs * cols + rows + (tokens + seqs * cols) * num_other_groups

    @staticmethod
    def from_wire(header: list[int], payload: torch.Tensor) -> StepBatch:
        _, tokens, seqs, cols, rows, max_q, max_ctx, num_other_groups = header
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * cols, rows] + [tokens, seqs * cols] * num_other_groups
        ids, pos, slots, cu, ctx, tables, logit_rows, *others = payload.split(sizes)
        cu, ctx = cu.int(), ctx.int()
        metas = [AttentionMetadata(s, PagedBatch(cu, ctx, t.view(seqs, cols).int(), max_q, max_ctx))
                 for s, t in zip([slots, *others[0::2]], [tables, *others[1::2]])]
        metas[0].other_groups = metas[1:]
        return StepBatch(ids, pos, metas[0], logit_rows)
