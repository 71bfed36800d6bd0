"""Hub-quantized safetensors checkpoints (FP8, compressed-tensors, GPTQ, AWQ): the scheme is read
from `quantization_config` and checked at start-up (`quant_scheme`), and as the loader streams the
checkpoint each linear layer's few packed tensors are gathered, dequantized into the run dtype,
yielded as a plain `<layer>.weight` and dropped (`dequantized_weights`), so the model only ever
sees dense weights and only one layer's packed tensors are held at a time.

Activation and KV-cache quantization (W8A8's input scales, `k_scale`/`v_scale`) are ignored:
activations run in the model's dtype. Layers a config leaves unquantized (`ignore`,
`modules_to_not_convert`, an unquantized `lm_head`) hold ordinary float weights and pass through.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger("engine")

SUPPORTED = {
    "fp8": "FP8 e4m3 weights with a per-tensor `weight_scale` or block-wise `weight_scale_inv`",
    "compressed-tensors": "formats float-quantized (FP8), int-quantized (int8), naive-quantized and "
                          "pack-quantized (int4/int8), per tensor, channel, group or block",
    "gptq": "4 or 8 bits, any group size, act-order (desc_act), symmetric or not, checkpoint_format gptq or gptq_v2",
    "awq": "4 bits, version gemm, with zero points",
}
_CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_CT_STRATEGIES = ("tensor", "channel", "group", "block")
# Activation and KV-cache quantization parameters: not used when activations run unquantized.
_ACTIVATION_PARTS = frozenset({"input_scale", "input_zero_point", "output_scale", "output_zero_point",
                               "activation_scale", "k_scale", "v_scale", "q_scale", "kv_scale"})
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each nibble of an AWQ word holds, lowest first


@dataclass(frozen=True)
class QuantScheme:
    """What the loader needs to know about a checkpoint's quantization, validated."""
    method: str
    bits: int | None = None
    group_size: int | None = None  # GPTQ/AWQ: input columns per group; -1: one group per row
    gptq_v1_zeros: bool = False  # GPTQ v1 checkpoints store each zero point minus one
    block_size: tuple[int, int] | None = None  # FP8 block-wise: rows and columns per scale
    quantizes_activations: bool = False


def quant_scheme(hf_config) -> QuantScheme | None:
    """The checkpoint's quantization scheme, or None for a float checkpoint. Raises ValueError
    naming the method or variant when this engine cannot load it."""
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict()
    method = str(cfg.get("quant_method", "")).lower()
    checks = {"fp8": _fp8_scheme, "compressed-tensors": _compressed_tensors_scheme,
              "gptq": _gptq_scheme, "awq": _awq_scheme}
    if method not in checks:
        raise ValueError(f"quantization method {method or '(none given)'!r} in quantization_config is not "
                         f"supported; supported: {_supported()}")
    return checks[method](cfg)


def _supported() -> str:
    return "; ".join(f"{name} ({what})" for name, what in SUPPORTED.items())


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"{method} checkpoint with {what} is not supported; {method} supports {SUPPORTED[method]}")


def _fp8_scheme(cfg: dict) -> QuantScheme:
    if str(cfg.get("fmt", "e4m3")).lower() != "e4m3":
        raise _refuse("fp8", f"fmt {cfg['fmt']!r}")
    if cfg.get("scale_fmt", "float") != "float" or cfg.get("expert_dtype", "fp8") != "fp8":
        raise _refuse("fp8", f"scale_fmt {cfg.get('scale_fmt')!r} / expert_dtype {cfg.get('expert_dtype')!r}")
    block = cfg.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise _refuse("fp8", f"weight_block_size {block!r}")
    return QuantScheme("fp8", 8, block_size=tuple(block) if block else None, quantizes_activations=True)


def _gptq_scheme(cfg: dict) -> QuantScheme:
    bits = cfg.get("bits")
    if bits not in (4, 8):
        raise _refuse("gptq", f"bits={bits}")
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format {fmt!r}")
    if str(cfg.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise _refuse("gptq", f"pack_dtype {cfg['pack_dtype']!r}")
    group = int(cfg.get("group_size", 128))
    if group < 1 and group != -1:
        raise _refuse("gptq", f"group_size={group}")
    return QuantScheme("gptq", bits, group, gptq_v1_zeros=fmt == "gptq")


def _awq_scheme(cfg: dict) -> QuantScheme:
    version = str(cfg.get("version") or cfg.get("format") or "gemm").lower()
    if cfg.get("bits", 4) != 4 or version != "gemm" or not cfg.get("zero_point", True):
        raise _refuse("awq", f"bits={cfg.get('bits')}, version {version!r}, zero_point={cfg.get('zero_point')}")
    group = int(cfg.get("group_size", 128))
    if group < 1 and group != -1:
        raise _refuse("awq", f"group_size={group}")
    return QuantScheme("awq", 4, group)


def _compressed_tensors_scheme(cfg: dict) -> QuantScheme:
    sparsity = cfg.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _refuse("compressed-tensors", f"sparsity format {sparsity['format']!r}")
    if cfg.get("transform_config"):
        raise _refuse("compressed-tensors", "a transform_config (rotations)")
    activations = False
    for name, group in (cfg.get("config_groups") or {}).items():
        fmt = group.get("format") or cfg.get("format")
        if fmt not in _CT_FORMATS:  # a "mixed-precision" checkpoint names each group's own format
            raise _refuse("compressed-tensors", f"format {fmt!r} (config group {name})")
        _check_ct_weights(name, group.get("weights"))
        activations |= bool(group.get("input_activations") or group.get("output_activations"))
    if not cfg.get("config_groups") and cfg.get("format") not in (*_CT_FORMATS, "dense"):
        raise _refuse("compressed-tensors", f"format {cfg.get('format')!r}")
    return QuantScheme("compressed-tensors", quantizes_activations=activations or bool(cfg.get("kv_cache_scheme")))


def _check_ct_weights(group: str, weights: dict | None) -> None:
    if weights is None:
        return
    kind, bits, strategy = weights.get("type", "int"), weights.get("num_bits"), weights.get("strategy", "tensor")
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)) or strategy not in _CT_STRATEGIES:
        raise _refuse("compressed-tensors", f"{kind} {bits}-bit weights, strategy {strategy!r} (config group {group})")


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], hf_config,
                        dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's `(name, tensor)` stream with every quantized linear layer's tensors replaced
    by one dense `<layer>.weight` in `dtype`; a float checkpoint's stream unchanged."""
    scheme = quant_scheme(hf_config)
    if scheme is None:
        yield from weights
        return
    log.info("quantized checkpoint", method=scheme.method, bits=scheme.bits, dtype=str(dtype).removeprefix("torch."),
             note="weights dequantized at load" + ("; activation and KV-cache quantization ignored, "
                                                   "activations run in this dtype" if scheme.quantizes_activations else ""))
    yield from _LayerGatherer(scheme, dtype).run(weights)


class _LayerGatherer:
    """Holds the parts of the layers in flight (normally one) until each is whole.

    A layer is dequantized once its required parts are in and the stream has moved on to another
    layer, so optional parts (`g_idx`, zero points), which sort beside the rest, are not missed;
    a layer cut across two shards waits until its missing parts come."""

    def __init__(self, scheme: QuantScheme, dtype: torch.dtype) -> None:
        self.scheme, self.dtype = scheme, dtype
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.dense: set[str] = set()  # layers stored unquantized: their leftover scales are dropped

    def run(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        current = None
        for name, tensor in weights:
            layer, _, part = name.rpartition(".")
            if layer != current:
                yield from self._flush(ready_only=True)
                current = layer
            if part in _ACTIVATION_PARTS:
                continue
            if not self._is_quantized_part(part, tensor):
                if part == "weight":
                    self.dense.add(layer)
                    self.pending.pop(layer, None)
                yield name, tensor
            elif layer not in self.dense:
                self.pending.setdefault(layer, {})[part] = tensor
        yield from self._flush(ready_only=False)

    def _is_quantized_part(self, part: str, tensor: torch.Tensor) -> bool:
        if part == "weight":
            return tensor.dtype in _QUANTIZED_DTYPES
        if self.scheme.method in ("gptq", "awq"):
            return part in ("qweight", "qzeros", "scales", "g_idx")
        return part.startswith("weight_")

    def _flush(self, ready_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        for layer in list(self.pending):
            parts = self.pending[layer]
            if not _missing(self.scheme.method, parts):
                del self.pending[layer]
                yield f"{layer}.weight", self._dequantize(layer, parts).to(self.dtype)
            elif not ready_only:
                raise ValueError(f"quantized layer {layer!r} is incomplete in the checkpoint: it has "
                                 f"{sorted(parts)} but lacks {_missing(self.scheme.method, parts)}")

    def _dequantize(self, layer: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        try:
            return _DEQUANTIZERS[self.scheme.method](parts, self.scheme)
        except (RuntimeError, ValueError, IndexError) as exc:
            shapes = {k: tuple(v.shape) for k, v in parts.items()}
            raise ValueError(f"cannot dequantize {layer!r} as {self.scheme.method} {shapes}: {exc}") from exc


def _missing(method: str, parts: dict[str, torch.Tensor]) -> list[str]:
    if method in ("gptq", "awq"):
        return [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    need = ["weight_packed", "weight_shape"] if "weight_packed" in parts else ["weight"]
    scales = ("weight_scale", "weight_scale_inv") if method == "fp8" else ("weight_scale",)
    return [p for p in need if p not in parts] + ([] if any(s in parts for s in scales) else [scales[0]])


# ---- the formats: each turns one layer's parts into a float32 [out_features, in_features] weight ----

def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32/bits unsigned fields along `dim`, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words.to(torch.int32).movedim(dim, -1).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten(-2).movedim(-1, dim)


def _by_column(per_group: torch.Tensor, columns: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """[out, groups] -> [out, columns]: each input column takes its group's value (contiguous groups
    unless `g_idx` names each column's group, as act-order does)."""
    if g_idx is None:
        size = -(-columns // per_group.shape[1])
        g_idx = torch.arange(columns) // size
    return per_group[:, g_idx.long()]


def _affine(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
            g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """(q - zero) * scale with [out, groups] scales and zero points spread over q's columns."""
    q = q.to(torch.float32)
    if zero is not None:
        q = q - _by_column(zero.to(torch.float32), q.shape[1], g_idx)
    return q * _by_column(scale.to(torch.float32), q.shape[1], g_idx)


def _gptq(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    # qweight [in/pack, out] packs input rows; qzeros [groups, out/pack] packs output columns.
    bits, mask = scheme.bits, (1 << scheme.bits) - 1
    q = _unpack(parts["qweight"], bits, 0)
    zeros = _unpack(parts["qzeros"], bits, 1)
    if scheme.gptq_v1_zeros:
        zeros = (zeros + 1) & mask
    g_idx = parts.get("g_idx")
    if g_idx is None and scheme.group_size and scheme.group_size > 0:
        g_idx = torch.arange(q.shape[0]) // scheme.group_size
    return _affine(q.T, parts["scales"].T, zeros[:, : q.shape[1]].T, g_idx)


def _awq(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    # qweight [in, out/8] and qzeros [groups, out/8] pack 8 output columns per word, interleaved.
    order = torch.argsort(torch.tensor(_AWQ_ORDER))

    def columns(words: torch.Tensor) -> torch.Tensor:
        fields = _unpack(words, 4, 1)
        return fields.view(fields.shape[0], -1, 8)[:, :, order].flatten(1)

    q, zeros = columns(parts["qweight"]), columns(parts["qzeros"])
    return _affine(q.T, parts["scales"].T, zeros.T)


def _fp8(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
    return _scaled(parts["weight"], scale, scheme.block_size)


def _scaled(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """FP8 (or symmetric int8) weight times a per-tensor, per-row, per-group or per-block scale."""
    rows, cols = weight.shape
    w, scale = weight.to(torch.float32), scale.to(torch.float32)
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.ndim < 2 or scale.shape[0] == rows:  # per row, or per group of columns
        return w * _by_column(scale.reshape(rows, -1), cols, None)
    block = block or (-(-rows // scale.shape[0]), -(-cols // scale.shape[1]))
    grid = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w * grid


def _compressed_tensors(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    scale, zero, g_idx = parts["weight_scale"], parts.get("weight_zero_point"), parts.get("weight_g_idx")
    if "weight_packed" not in parts:  # float-, int- or naive-quantized: one value per byte
        q = parts["weight"]
        if zero is None and g_idx is None:
            return _scaled(q, scale, None)
    else:  # pack-quantized: 32/bits values per int32 along each row, stored as value + 2**(bits-1)
        rows, cols = (int(n) for n in parts["weight_shape"].tolist())
        packed = parts["weight_packed"]
        bits = 32 // -(-cols // packed.shape[1])
        q = _unpack(packed, bits, 1)[:, :cols] - (1 << (bits - 1))
        if zero is not None and zero.dtype == torch.int32 and zero.shape[0] < rows:  # packed down the rows
            zero = _unpack(zero, bits, 0)[:rows] - (1 << (bits - 1))
    rows = q.shape[0]
    return _affine(q, _as_rows(scale, rows), None if zero is None else _as_rows(zero, rows), g_idx)


def _as_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor, per-row or per-group tensor as [rows, groups]."""
    return t.reshape(1, 1).expand(rows, 1) if t.numel() == 1 else t.reshape(rows, -1)


_DEQUANTIZERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}
