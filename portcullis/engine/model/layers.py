"""Model building blocks that shard themselves for tensor parallelism.

Each parallel layer reads the TP rank and size at construction, allocates only its shard, and
carries a `weight_loader` that slices a full checkpoint tensor into that shard. At TP=1 they are
plain layers.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from portcullis.engine.compat.torch import pack_weight, packed_linear
from portcullis.engine.distributed import (
    all_gather_last_dim,
    all_reduce,
    divide,
    tp_rank,
    tp_size,
)
from portcullis.kernels import cpu_quant, cpu_rotary


@dataclass(frozen=True)
class QuantizedLinear:
    """How a layer whose weight is GGUF blocks (uint8 ``[out, in / 32 * bytes]``, a row per output
    feature, as `keep_quantized` made it) multiplies: the CPU kernel of `kernels.cpu_quant`."""

    kind: str  # a key of cpu_quant.KINDS
    lib: ctypes.CDLL
    dtype: torch.dtype  # the model's: what the layer returns

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = cpu_quant.quant_matmul(self.lib, x.reshape(-1, x.shape[-1]), blocks, self.kind)
        y = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y + bias

    def rows(self, blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``ids`` dequantized."""
        out = cpu_quant.dequantize_rows(self.lib, blocks, self.kind, ids=ids.reshape(-1))
        return out.reshape(*ids.shape, out.shape[-1]).to(self.dtype)


def keep_quantized(layer: nn.Module, kind: str, lib: ctypes.CDLL) -> None:
    """Give `layer` (on the meta device, before `to_empty`) a weight of GGUF blocks of `kind` in
    place of its float weight: its weight_loader then copies rows of blocks as it copied rows of
    floats. Only unsharded (TP=1) layers: a row-parallel shard would cut blocks."""
    out_features, in_features = layer.weight.shape
    dtype = layer.weight.dtype
    layer.weight = nn.Parameter(torch.empty(out_features, cpu_quant.row_bytes(in_features, kind), dtype=torch.uint8,
                                            device=layer.weight.device), requires_grad=False)
    layer.quantized = QuantizedLinear(kind, lib, dtype)


def _copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _matmul(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): through the quantized kernel for GGUF blocks, else the layer's
    oneDNN-packed weight once `pack_linear_weights` made one."""
    if layer.quantized is not None:
        return layer.quantized.matmul(x, layer.weight, bias)
    packed = layer.packed
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return packed_linear(x, packed, bias)


def repack_for_int8_activations(model: nn.Module) -> dict[str, int]:
    """Reorder the GGUF blocks of every layer the int8-activation kernel runs (Q8_0, Q4_0, Q4_1,
    rows a multiple of 16) for it, in place; a table shared by the embedding and a tied head is
    repacked once (its embedding rows still dequantize exactly). Returns the layers per new kind."""
    repacked_as: dict[int, str | None] = {}  # by the weight's identity: a shared table once
    kinds: dict[str, int] = {}
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if quantized is None:
            continue
        weight = module.weight
        if id(weight) not in repacked_as:
            repacked = cpu_quant.repack_int8(quantized.lib, weight.data, quantized.kind)
            repacked_as[id(weight)] = None if repacked is None else repacked[1]
            if repacked is not None:
                weight.data = repacked[0]
        kind = repacked_as[id(weight)]
        if kind is not None:
            module.quantized = QuantizedLinear(kind, quantized.lib, quantized.dtype)
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def pack_linear_weights(model: nn.Module) -> int:
    """On a CPU, lay every linear weight out once in oneDNN's blocked format, as torch.compile's
    CPU backend does for frozen weights, and multiply through oneDNN from then on (1.4-3.4x MKL's
    GEMM: `engine.compat.torch`). The unpacked weight is dropped (no second copy), except a head
    tied to the embedding, whose table the embedding still reads. Returns the layers packed; 0
    where oneDNN is missing or disagrees with F.linear on a probe (then nothing changes)."""
    layers = [m for m in model.modules() if hasattr(m, "packed") and m.quantized is None]
    if not layers or not _onednn_agrees(layers[0].weight.dtype):
        return 0
    tied = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)
            and not isinstance(m, ParallelLMHead)}
    for layer in layers:
        weight = layer.weight
        layer.packed = pack_weight(weight.detach())
        if id(weight) not in tied:
            layer.weight = None
    stacked = [m for m in model.modules() if hasattr(m, "pack_for_onednn")]  # e.g. a MoE's experts
    for module in stacked:
        module.pack_for_onednn()
    return len(layers) + len(stacked)


def _onednn_agrees(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 40, generator=gen).to(dtype), torch.randn(5, 40, generator=gen).to(dtype)
        got = packed_linear(x, pack_weight(w))
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2))


class ReplicatedLinear(nn.Module):
    """A linear layer every rank holds whole."""

    quantized: QuantizedLinear | None = None  # set by keep_quantized: the weight is GGUF blocks

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.packed: torch.Tensor | None = None  # oneDNN's layout of `weight` (pack_linear_weights)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_into(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across ranks; each rank returns its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, divide(out_features, tp_size()), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _copy_into(param, loaded.narrow(0, tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # a checkpoint that stores them fused (Phi-3's gate_up_proj): split, then shard each
            for i, part in enumerate(loaded.split(self.output_sizes)):
                self.weight_loader(param, part, i)
            return
        offset = sum(self.output_sizes[:shard_id]) // tp_size()
        size = self.output_sizes[shard_id] // tp_size()
        shard = loaded.narrow(0, tp_rank() * size, size)
        _copy_into(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; each rank holds its heads of each."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        # With more ranks than KV heads, each KV head is replicated on several ranks.
        self.num_kv_heads = max(1, num_kv_heads // tp) if num_kv_heads < tp else divide(num_kv_heads, tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        ReplicatedLinear.__init__(self, hidden, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # a checkpoint that stores them fused (Phi-3's qkv_proj): split, then shard each
            kv = self.total_kv_heads * self.head_dim
            for part, shard in zip(loaded.split([self.num_heads * tp_size() * self.head_dim, kv, kv]), "qkv"):
                self.weight_loader(param, part, shard)
            return
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, tp_rank()
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, tp_rank() // self.kv_replicas
        _copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, index * size, size))


class RowParallelLinear(ReplicatedLinear):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(divide(in_features, tp_size()), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            _copy_into(param, loaded)
            return
        size = param.shape[1]
        _copy_into(param, loaded.narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(_matmul(x, self))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; tokens outside a rank's range contribute zeros."""

    quantized: QuantizedLinear | None = None  # set by keep_quantized: the table is GGUF blocks

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded[self.start : self.start + self.shard_size]
        param.data.zero_()
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:  # TP=1 only (keep_quantized)
            return self.quantized.rows(self.weight, ids)
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded by vocabulary; logits are gathered to every rank."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__(vocab_size, hidden)
        self.packed: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(_matmul(hidden, self))
        return logits[..., : self.vocab_size]


class MissingLayer(nn.Module):
    """Stands where another pipeline stage holds the part (a decoder layer, the embedding, the
    norm or the head): no weights here, and the loader skips the checkpoint's tensors for it."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model is held by another pipeline stage")


def held_here(model: nn.Module, name: str) -> bool:
    """False when `name` (a parameter's dotted path) lies under a `MissingLayer` of `model`."""
    module, parts = model, name.split(".")[:-1]
    for part in parts:
        module = getattr(module, part, None)
        if module is None or isinstance(module, MissingLayer):
            return module is None  # a path that does not exist is the caller's error, not a stage's
    return True


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Hugging Face does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # no conversions to dispatch (a decode step has 61 norms)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def normed_matmul(norm: RMSNorm, layer: ReplicatedLinear, x: torch.Tensor) -> torch.Tensor:
    """``layer(norm(x))``: one native call where the weight is GGUF blocks, ``x`` float32 rows and
    the norm Llama's (at one row the norm's six PyTorch ops cost as much as the product)."""
    quantized = layer.quantized
    if quantized is None or type(norm) is not RMSNorm or x.dtype != torch.float32 or x.dim() != 2:
        return layer(norm(x))
    y = cpu_quant.norm_matmul(quantized.lib, x, norm.weight, norm.eps, layer.weight, quantized.kind)
    return y if layer.bias is None else y + layer.bias


def residual_matmul(layer: ReplicatedLinear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + layer(x)``: one native call where the weight is GGUF blocks (TP=1, so no
    all-reduce) and the rows float32."""
    quantized = layer.quantized
    if quantized is None or layer.bias is not None or residual.dtype != torch.float32 or x.dim() != 2:
        return residual + layer(x)
    return cpu_quant.matmul_add(quantized.lib, x, layer.weight, quantized.kind, residual)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `x * cos + rotate_half(x) * sin`, bit for bit, in four ops instead of seven:
    rotate_half(x) is cat(-x2, x1), so it equals roll(x, half) times a sin whose first half is
    negated (`RotaryEmbedding.sin`); a product's sign is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with precomputed cos and (signed, see `rotate`) sin tables
    indexed by position."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Kept as plain attributes: the model is built on the meta device, and these must be real.
        self.cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # signed for `rotate`
        # On CPUs the rows of a forward's positions are gathered once, not once per layer: every
        # layer shares this module and the runner builds a new positions tensor per forward. (Not
        # on GPUs, where a captured graph would replay the same tensor with new contents.)
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._in_range: torch.Tensor | None = None  # the last positions checked for the native kernel

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.cos.device != q.device or self.cos.dtype != q.dtype:
            self.cos, self.sin = self.cos.to(q.device, q.dtype), self.sin.to(q.device, q.dtype)
            self._rows = None
        if q.device.type == "cpu" and (rotated := self._rotate_natively(positions, q, k)) is not None:
            return rotated
        rows = self._rows  # read once: another thread's forward may replace it meanwhile
        if rows is None or rows[0] is not positions:
            rows = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
            self._rows = rows if positions.device.type == "cpu" else None
        _, cos, sin = rows
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def _rotate_natively(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """`forward` in one native call (float32 on a CPU, the kernel built), else None. The kernel
        trusts its positions, so each forward's are checked once against the tables."""
        lib = cpu_rotary.native_library()
        if lib is None or q.dtype != torch.float32:
            return None
        self.check_positions(positions)
        return cpu_rotary.rotate(lib, q, k, positions, self.cos, self.sin)

    def check_positions(self, positions: torch.Tensor) -> None:
        """Refuse positions past the tables, once per forward's positions tensor: native kernels
        index the tables with them unchecked."""
        if self._in_range is not positions:
            if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < len(self.cos):
                raise IndexError(f"positions beyond the rotary tables' {len(self.cos)} rows")
            self._in_range = positions


QUANTIZABLE = (ReplicatedLinear, VocabParallelEmbedding)  # layers keep_quantized knows how to run
