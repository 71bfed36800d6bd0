"""A test-side quantizer: writes quantized copies of a small float checkpoint in the on-disk layouts
and `quantization_config` keys that Hub checkpoints use (GPTQ, AWQ GEMM, FP8, compressed-tensors),
with a float32 "reference" checkpoint beside each that holds the quantizer's own dequantization of
what it packed: the same weights, unpacked, for transformers to run.

Written from the published formats, on purpose sharing no code with the engine's loader
(`portcullis/engine/model/quantization.py`), so that a misread layout shows up as a mismatch.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: word nibble i holds column 8c + order[i]


@dataclass
class QuantizedCheckpoint:
    path: Path  # the quantized checkpoint (two safetensors shards and an index)
    reference: Path  # float32 checkpoint of the dequantized weights
    dequantized: dict[str, torch.Tensor] = field(repr=False)  # "<layer>.weight" -> float32, quantized layers only
    original: dict[str, torch.Tensor] = field(repr=False)  # every tensor of the float checkpoint
    skipped: tuple[str, ...] = ()  # linear layers the config leaves unquantized


# ---- packing, written out field by field ----

def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] unsigned fields -> [rows / (32/bits), cols]: word r holds rows r*k .. r*k+k-1, lowest bits first."""
    k = 32 // bits
    v = values.to(torch.int64)
    words = torch.zeros(v.shape[0] // k, v.shape[1], dtype=torch.int64)
    for j in range(k):
        words |= v[j::k] << (bits * j)
    return _to_int32(words)


def pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[rows, cols] unsigned fields -> [rows, ceil(cols / (32/bits))]; field j of word c holds
    column c*k + order[j] (columns past the end are zero)."""
    k = 32 // bits
    order = order or tuple(range(k))
    v = values.to(torch.int64)
    pad = -v.shape[1] % k
    v = torch.nn.functional.pad(v, (0, pad))
    words = torch.zeros(v.shape[0], v.shape[1] // k, dtype=torch.int64)
    for j in range(k):
        words |= v[:, order[j]::k] << (bits * j)
    return _to_int32(words)


# ---- one linear weight [out, in] -> its stored tensors and their exact dequantization ----

def gptq_layer(w: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool, v1: bool, seed: int):
    out_f, in_f = w.shape
    maxq = 2**bits - 1
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_f) // group).to(torch.int32)  # act-order: groups follow the permutation
    groups = in_f // group
    scales = torch.empty(groups, out_f)
    zeros = torch.empty(groups, out_f, dtype=torch.int64)
    for g in range(groups):
        block = w[:, perm[g * group:(g + 1) * group]]
        if sym:
            scales[g] = (2 * block.abs().amax(1) / maxq).clamp_min(1e-6)
            zeros[g] = (maxq + 1) // 2
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scales[g] = ((hi - lo) / maxq).clamp_min(1e-6)
            zeros[g] = torch.round(-lo / scales[g]).to(torch.int64)
    scales = scales.half()
    s, z = scales.float()[g_idx.long()].T, zeros[g_idx.long()].T  # [out, in]
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).to(torch.int64)
    stored_zeros = (zeros - 1) & maxq if v1 else zeros  # GPTQ v1 stores zero - 1
    tensors = {"qweight": pack_rows(q.T, bits), "qzeros": pack_cols(stored_zeros, bits), "scales": scales, "g_idx": g_idx}
    return tensors, (q - z).float() * s


def awq_layer(w: torch.Tensor, group: int):
    out_f, in_f = w.shape
    blocks = w.reshape(out_f, in_f // group, group)
    lo, hi = blocks.amin(2).clamp(max=0), blocks.amax(2).clamp(min=0)
    scales = ((hi - lo) / 15).clamp_min(1e-6).half()  # [out, groups]
    zeros = torch.clamp(torch.round(-lo / scales.float()), 0, 15).to(torch.int64)
    s, z = scales.float().repeat_interleave(group, 1), zeros.repeat_interleave(group, 1)
    q = torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int64)
    tensors = {"qweight": pack_cols(q.T, 4, AWQ_PACK_ORDER), "qzeros": pack_cols(zeros.T, 4, AWQ_PACK_ORDER),
               "scales": scales.T.contiguous()}
    return tensors, (q - z).float() * s


def fp8_block_layer(w: torch.Tensor, block: int):
    out_f, in_f = w.shape
    tiles = w.reshape(out_f // block, block, in_f // block, block)
    scale = (tiles.abs().amax((1, 3)) / FP8_MAX).clamp_min(1e-12)  # [out/b, in/b], float32
    grid = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (w / grid).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * grid


def fp8_tensor_layer(w: torch.Tensor):
    scale = w.abs().max() / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.02)}, q.float() * scale


def ct_fp8_channel_layer(w: torch.Tensor):
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).to(torch.bfloat16)  # llm-compressor keeps scales in bf16
    q = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def ct_int8_channel_layer(w: torch.Tensor):
    scale = w.abs().amax(1, keepdim=True) / 127
    q = torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def ct_int4_layer(w: torch.Tensor, group: int, sym: bool, act_order: bool, seed: int):
    out_f, in_f = w.shape
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_f) // group
    cols = torch.stack([w[:, perm[g * group:(g + 1) * group]] for g in range(in_f // group)], 1)  # [out, groups, group]
    if sym:
        scale = (cols.abs().amax(2) / 7).to(torch.bfloat16)
        zero = torch.zeros_like(scale, dtype=torch.int64)
    else:
        lo, hi = cols.amin(2).clamp(max=0), cols.amax(2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-6).to(torch.bfloat16)
        zero = torch.clamp(torch.round(-lo / scale.float()) - 8, -8, 7).to(torch.int64)
    s, z = scale.float()[:, g_idx], zero[:, g_idx]
    q = torch.clamp(torch.round(w / s) + z, -8, 7).to(torch.int64)
    tensors = {"weight_packed": pack_cols(q + 8, 4), "weight_scale": scale,
               "weight_shape": torch.tensor([out_f, in_f])}
    if not sym:
        tensors["weight_zero_point"] = pack_rows(torch.nn.functional.pad(zero + 8, (0, 0, 0, -out_f % 8)), 4)
    if act_order:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, (q - z).float() * s


# ---- formats: how each layer is stored, and the config that says so ----

def _ct_config(weights: dict, fmt: str, inputs: dict | None, ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None, "format": fmt}},
        "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
    }


def _ct_args(bits: int, kind: str, strategy: str, group: int | None = None, sym: bool = True, actorder=None) -> dict:
    return {"num_bits": bits, "type": kind, "symmetric": sym, "strategy": strategy, "group_size": group,
            "block_structure": None, "dynamic": False, "actorder": actorder, "observer": "minmax", "observer_kwargs": {}}


_TOKEN_FP8 = {**_ct_args(8, "float", "token"), "dynamic": True, "observer": None}
_TOKEN_INT8 = {**_ct_args(8, "int", "token"), "dynamic": True, "observer": None}
SKIP = "model.layers.1.mlp.down_proj"  # left unquantized where a format below says so


def _gptq_config(bits=4, group=128, sym=True, act_order=False, fmt="gptq"):
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "lm_head": False,
            "checkpoint_format": fmt, "pack_dtype": "int32"}


FORMATS = {
    # name: (config, layer quantizer(weight, seed), layers left unquantized)
    "gptq": (_gptq_config(), lambda w, s: gptq_layer(w, 4, 128, True, False, True, s), ()),
    "gptq-act-order": (_gptq_config(act_order=True), lambda w, s: gptq_layer(w, 4, 128, True, True, True, s), ()),
    "gptq-asym-v1": (_gptq_config(sym=False), lambda w, s: gptq_layer(w, 4, 128, False, True, True, s), ()),
    "gptq-asym-v2": (_gptq_config(sym=False, fmt="gptq_v2"), lambda w, s: gptq_layer(w, 4, 128, False, False, False, s), ()),
    "gptq-8bit": (_gptq_config(bits=8, group=64), lambda w, s: gptq_layer(w, 8, 64, True, True, True, s), ()),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": [SKIP]}, lambda w, s: awq_layer(w, 128), (SKIP,)),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
                   "modules_to_not_convert": ["lm_head", SKIP]}, lambda w, s: fp8_block_layer(w, 128), (SKIP,)),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3"},
                   lambda w, s: fp8_tensor_layer(w), ()),
    "ct-fp8-channel": (_ct_config(_ct_args(8, "float", "channel"), "float-quantized", _TOKEN_FP8,
                                  ["lm_head", "re:.*layers[.]1[.]mlp[.]down_proj$"]),
                       lambda w, s: ct_fp8_channel_layer(w), (SKIP,)),
    "ct-int4": (_ct_config(_ct_args(4, "int", "group", 128), "pack-quantized", None, ["lm_head"]),
                lambda w, s: ct_int4_layer(w, 128, True, False, s), ()),
    "ct-int4-asym-act-order": (_ct_config(_ct_args(4, "int", "group", 128, sym=False, actorder="group"),
                                          "pack-quantized", None, ["lm_head"]),
                               lambda w, s: ct_int4_layer(w, 128, False, True, s), ()),
    "ct-int8": (_ct_config(_ct_args(8, "int", "channel"), "int-quantized", _TOKEN_INT8, ["lm_head"]),
                lambda w, s: ct_int8_channel_layer(w), ()),
}


def quantize_checkpoint(src: Path, out: Path, fmt: str) -> QuantizedCheckpoint:
    """Write `out/quantized` (the `fmt` checkpoint) and `out/reference` from the float checkpoint `src`."""
    config, quantize_layer, skipped = FORMATS[fmt]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        original = {name: f.get_tensor(name) for name in f.keys()}
    stored, reference, dequantized = {}, {}, {}
    for seed, (name, tensor) in enumerate(sorted(original.items())):
        layer = name.removesuffix(".weight")
        if layer.rsplit(".", 1)[-1] in LINEAR_LAYERS and name.endswith(".weight") and layer not in skipped:
            parts, deq = quantize_layer(tensor.float(), seed)
            stored.update({f"{layer}.{part}": t.contiguous() for part, t in parts.items()})
            reference[name] = dequantized[name] = deq
        else:
            stored[name] = reference[name] = tensor
    quantized_dir, reference_dir = out / "quantized", out / "reference"
    for folder in (quantized_dir, reference_dir):
        folder.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():
            if extra.is_file() and not extra.name.endswith(".safetensors"):
                shutil.copy(extra, folder / extra.name)
    save_file(reference, str(reference_dir / "model.safetensors"))
    _save_sharded(stored, quantized_dir)
    cfg = json.loads((src / "config.json").read_text())
    (quantized_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}, indent=2))
    return QuantizedCheckpoint(quantized_dir, reference_dir, dequantized, original, tuple(skipped))


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Two shards cut mid-way through the sorted names, so a layer's parts may straddle them, as on the Hub."""
    names = sorted(tensors)
    cut = len(names) // 2 + 1
    shards = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
