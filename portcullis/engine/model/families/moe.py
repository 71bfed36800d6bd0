"""The mixture-of-experts layer: a top-k softmax router and every expert's SwiGLU MLP stacked in one
parameter per projection, run as grouped matmuls over the tokens sorted by expert.

Tensor parallelism splits each expert's intermediate features across ranks, as the dense MLP does:
gate/up column-wise, down row-wise, one all-reduce of the summed expert outputs.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from portcullis.engine.compat.torch import pack_weight, packed_linear
from portcullis.engine.distributed import all_reduce, divide, tp_rank, tp_size
from portcullis.engine.model.layers import ReplicatedLinear

# One expert's projection as checkpoints name it: Mixtral's w1/w3/w2 (under `block_sparse_moe`), the
# Qwen MoE families' gate_proj/up_proj/down_proj (under `mlp`). transformers 5.x keeps the experts
# fused in memory and writes these per-expert names back when it saves.
_EXPERT_WEIGHT = re.compile(r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_PROJECTION = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_weight_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """Our stacked parameter and (expert, projection) for a per-expert checkpoint tensor, else None."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    prefix, expert, proj = match.groups()
    part = _PROJECTION[proj]
    param = "down_proj" if part == "down" else "gate_up_proj"
    return f"{prefix}.mlp.experts.{param}", (int(expert), part)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the `top_k` largest, optionally rescaled to sum to one.
    Returns float32 weights and the chosen experts' ids, both [tokens, top_k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StackedExperts(nn.Module):
    """Every expert's gate/up ([experts, 2 * inter, hidden]) and down ([experts, hidden, inter])
    projections, this rank's slice of the intermediate features only. The output is this rank's
    partial sum: the caller all-reduces it."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.inter = divide(intermediate, tp_size())
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, self.inter), requires_grad=False)
        # Per expert, (gate_up, down) in oneDNN's layout once `pack_for_onednn` made them.
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def pack_for_onednn(self) -> None:
        """Lay each expert's weights out for oneDNN, as `layers.pack_linear_weights` does for linear
        layers (it calls this): an expert multiplies a few rows at a time, where packed weights were
        measured 2-3x faster than F.linear (1-32 rows, expert-sized weights, one thread, float32).
        The stacked parameters are dropped."""
        self.packed_experts = [(pack_weight(self.gate_up_proj[e].detach()), pack_weight(self.down_proj[e].detach()))
                               for e in range(self.num_experts)]
        self.gate_up_proj = None
        self.down_proj = None

    def _matmul(self, x: torch.Tensor, expert: int, down: bool) -> torch.Tensor:
        if self.packed_experts is None:
            return F.linear(x, (self.down_proj if down else self.gate_up_proj)[expert])
        return packed_linear(x, self.packed_experts[expert][down])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str] | None = None) -> None:
        """One expert's projection (`shard` = (expert, "gate" | "up" | "down")) as older checkpoints
        store it, or (no shard) all experts' fused 3-D tensor as transformers 5.x holds it in memory."""
        if shard is None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"fused expert tensor has {loaded.shape[0]} experts, expected {self.num_experts}")
            if param is self.gate_up_proj:
                gate, up = loaded.chunk(2, dim=1)
                for e in range(self.num_experts):
                    self.weight_loader(param, gate[e], (e, "gate"))
                    self.weight_loader(param, up[e], (e, "up"))
            else:
                for e in range(self.num_experts):
                    self.weight_loader(param, loaded[e], (e, "down"))
            return
        expert, part = shard
        size, start = self.inter, tp_rank() * self.inter
        if part == "down":
            _copy(param.data[expert], loaded.narrow(1, start, size))
        else:
            offset = 0 if part == "gate" else size
            _copy(param.data[expert].narrow(0, offset, size), loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]; weights and ids [tokens, top_k]. Each (token, expert) pair is sorted by
        expert so that every expert multiplies one contiguous slice. (torch's F.grouped_mm runs on
        CPUs too, but measured no faster than this loop there, 1-512 tokens, and gave the same bits;
        it cannot use the packed weights.)"""
        top_k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        token = order // top_k
        rows = x[token]
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                gate, up = self._matmul(rows[start:start + n], expert, down=False).split(self.inter, dim=-1)
                out[start:start + n] = self._matmul(F.silu(gate) * up, expert, down=True)
                start += n
        # The product is taken in the weights' dtype and summed in x's, as transformers does.
        scaled = (out * weights.flatten()[order].unsqueeze(-1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, scaled)


class SparseMoeBlock(nn.Module):
    """Router (`gate`) and experts; Qwen2-MoE adds a shared expert every token passes through,
    weighed by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg, shared_expert: nn.Module | None = None):
        super().__init__()
        num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        # Mixtral always renormalises the top-k and weighs expert outputs in float32; the Qwen
        # families renormalise when `norm_topk_prob` and round the weights to the model's dtype first.
        self.mixtral = cfg.model_type == "mixtral"
        self.renormalize = self.mixtral or bool(getattr(cfg, "norm_topk_prob", False))
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (only silu)")
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        self.gate = ReplicatedLinear(cfg.hidden_size, num_experts)
        self.experts = StackedExperts(num_experts, cfg.hidden_size, inter)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if not self.mixtral:
            weights = weights.to(x.dtype)
        out = all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
