"""oneDNN's packed linear, which torch.compile's CPU backend uses for frozen weights and torch
does not document (`torch.ops.mkldnn`): what `model.layers` and the MoE experts multiply with once
`pack_linear_weights` laid their weights out. Pinned by tests/engine/test_compat.py; at load a
probe (`layers._onednn_agrees`) checks it against F.linear, and where it is missing or disagrees
the weights stay unpacked.

Why: measured on the AMD EPYC this project runs on (one thread, float32), 1.4x MKL's GEMM at 2048
rows, 1.8x at 128 and 3.2-3.4x at 1-6 rows (a decode step, a verification of a few proposals),
where MKL falls back to slow paths; 2-3x for an expert's few rows (1-32, expert-sized weights)."""
from __future__ import annotations

import torch


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight ([out, in]) in oneDNN's blocked layout, for `packed_linear` only."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for `x` of any leading shape, the weight as `pack_weight` laid it out."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
