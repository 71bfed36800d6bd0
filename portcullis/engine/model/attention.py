"""Per-step attention metadata and the attention layer that reads and writes the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from portcullis import kernels


@dataclass
class AttentionMetadata:
    """What every attention layer needs for one engine step; built once by the model runner."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where this step's K/V rows are written
    batch: kernels.PagedBatch  # where the sequences sit in the cache, and the step's plan memo
    # With several KV-cache groups (sliding-window layers that free blocks), groups 1.. have their
    # own slots and block tables; the layers of group 0 read the fields above.
    other_groups: list[AttentionMetadata] = field(default_factory=list)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's cache blocks, then attends over the block table.
    `scale` defaults to head_dim ** -0.5; `softcap` soft-caps the scores (Gemma 2), None is off."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None,
                 scale: float | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the model runner
        self.kv_group = 0  # its KV-cache group (whose block tables it reads), set by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = self.kv_cache
        if self.kv_group:
            meta = meta.other_groups[self.kv_group - 1]
        kernels.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        return kernels.paged_attention(
            q, key_cache, value_cache, meta.batch, scale=self.scale, sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
