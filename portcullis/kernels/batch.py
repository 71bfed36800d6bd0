"""The batch's layout over the paged KV cache: what every attention layer of one step reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PagedBatch:
    """Where one step's sequences sit in the query rows and in the paged cache.

    Built once per step and passed to every layer; what differs per layer (``scale``,
    ``sliding_window``) is an argument of the call instead. ``plan`` is the step's memo: the
    PyTorch path keeps its indices and masks there so that all layers share them, which is why
    a new step needs a new batch and the tensors must not change while one is in use.
    """

    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]: each sequence's first query row
    context_lens: torch.Tensor  # int32 [num_seqs]: cached tokens, this step's included
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: logical to physical blocks
    # Known bounds spare the GPU path a device sync; None when the caller does not know them.
    max_query_len: int | None = None
    max_context_len: int | None = None
    plan: dict = field(default_factory=dict, repr=False, compare=False)
