"""GGUF checkpoints, the single files llama.cpp and Ollama run: the architecture, tokenizer and
chat template come from the file's metadata; on CPUs Q8_0, Q4_0 and Q4_1 weights run as stored
(the loader's `keep_gguf_quantized`), everything else is dequantized at load into the run dtype,
one tensor at a time.

The `gguf` package reads the file; transformers turns its metadata into a config and a tokenizer
(its public `from_pretrained(..., gguf_file=...)`). Both take seconds per start for a large
vocabulary (the reader parses 262k Gemma tokens one by one: 20 s on this project's CPUs), so they
run once per file: `sidecar_folder` writes config.json (with what llama.cpp writes and transformers'
reader drops: `_METADATA`, and Llama 3's RoPE scaling from its `rope_freqs` tensor), the tokenizer
files and an index of the tensors (name, type, shape, byte range, as the reader found them) into a
folder in the cache.
`gguf_tensors` then maps the file and yields each tensor in its stored layout (`GGUFWeight`), for
a kernel that multiplies quantized weights as they are stored; `gguf_weights` dequantizes them
under the Hugging Face names the model files load.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from portcullis import envs
from portcullis.engine.assets import cache_root

log = structlog.get_logger("engine")

# GGUF's `general.architecture` -> the Hugging Face architecture our model registry serves.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # llama.cpp writes Mistral checkpoints as "llama" too
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Set to 1: dequantize every tensor at load even where the CPU kernel runs it as stored.
DEQUANTIZE_ENV = envs.GGUF_DEQUANTIZE.name
# Tensor types dequantized at load (what the `gguf` package decodes and llama.cpp files hold).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor names -> Hugging Face names. Top level first, then per block (`blk.N.`).
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma has four norms per block; llama.cpp names the one before the MLP `ffn_norm`.
_GEMMA_BLOCK = {**_BLOCK, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps Q/K/V in one tensor, and gate/up in one named `ffn_up`.
_PHI3_BLOCK = {**_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Mixtures of experts: the router, each projection of every expert stacked [experts, rows, columns]
# (split into per-expert tensors at load), and Qwen2-MoE's shared expert with its gate.
_MOE_BLOCK = {
    **_BLOCK, "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_BLOCK_NAMES = {"gemma2": _GEMMA_BLOCK, "gemma3": _GEMMA_BLOCK, "phi3": _PHI3_BLOCK,
                "qwen2moe": _MOE_BLOCK, "qwen3moe": _MOE_BLOCK}
# Llama 3.x RoPE scaling: llama.cpp's converter stores it as one factor per frequency (each
# frequency divided by it), not as metadata; the config is rebuilt from it (`_llama3_rope`).
_ROPE_FREQS = "rope_freqs.weight"

# Metadata llama.cpp writes that transformers' GGUF reader leaves at the config class's defaults:
# `<arch>.<key>` -> config field, filled into the sidecar config where the file holds it.
_METADATA = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "phi3": {"attention.sliding_window": "sliding_window"},
}
# Gemma 2/3 scale queries by 1/sqrt(query_pre_attn_scalar), which llama.cpp does not store: it uses
# the head size, except for the 27B models (known by their block count), which use hidden/heads.
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


@dataclass(frozen=True)
class GGUFWeight:
    """One tensor as stored: `data` is the file's memory-mapped bytes (or values, for F32/F16),
    `kind` its GGML type name, `shape` in PyTorch order (rows, columns)."""

    name: str  # the Hugging Face name
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray

    def dequantize(self) -> torch.Tensor:
        import gguf

        values = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape)  # a copy: the file is read-only


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:  # a truncated or foreign file
        raise ValueError(f"{path.name}: not a readable GGUF file ({exc})") from exc


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def architecture_of(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    if arch == "llama" and _field(reader, "llama.expert_count"):
        # transformers reads such a file as a dense Llama, without its experts
        raise ValueError("GGUF architecture 'llama' with experts (Mixtral) is not supported; "
                         "convert the Hugging Face checkpoint folder instead")
    return arch


def check_tensor_types(reader) -> None:
    unknown = sorted({t.tensor_type.name for t in reader.tensors} - set(TENSOR_TYPES))
    if unknown:
        raise ValueError(f"GGUF tensor type {', '.join(unknown)} is not supported; supported: {', '.join(TENSOR_TYPES)}")


INDEX = "gguf_tensors.json"
# Part of the cache key: a new version of what the sidecar holds (metadata filled in) makes new ones.
_SIDECAR_VERSION = 3


def sidecar_folder(path: Path, cache: Path | None = None) -> Path:
    """A Hugging Face folder (config.json, tokenizer files, chat template) and the tensor index,
    made from the file once, kept in `cache` under a key of the file's identity and transformers'
    version (an edited file, a new converter or a new `_SIDECAR_VERSION` makes a new one). Refuses an
    unknown architecture, tensor type or tensor before converting anything."""
    import transformers

    cache = cache or cache_root() / "gguf"
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{_SIDECAR_VERSION}"
    key = hashlib.sha256(identity.encode())
    folder = cache / f"{path.stem}-{key.hexdigest()[:16]}"
    if (folder / INDEX).is_file():  # checked when it was made, from this very file
        return folder
    started = time.perf_counter()
    reader = _reader(path)
    arch = architecture_of(reader)
    check_tensor_types(reader)
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=cache, prefix=".convert-"))
    try:
        index = _tensor_index(reader, arch)  # refuses a tensor the model has no place for, before the slow part
        _convert_metadata(path, reader, arch, scratch)
        (scratch / INDEX).write_text(json.dumps(index))
        shutil.rmtree(folder, ignore_errors=True)  # one left incomplete by an older version
        try:
            os.replace(scratch, folder)
        except OSError:  # another process (a tensor-parallel rank) made it meanwhile
            shutil.rmtree(scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    log.info("gguf metadata converted", file=path.name, folder=str(folder),
             seconds=round(time.perf_counter() - started, 2))
    return folder


def _tensor_index(reader, arch: str) -> dict:
    blocks = _BLOCK_NAMES.get(arch, _BLOCK)
    tensors = [
        {"name": _hf_name(t.name, blocks), "kind": t.tensor_type.name,
         "shape": [int(n) for n in reversed(t.shape.tolist())], "offset": int(t.data_offset),
         "data_shape": list(t.data.shape), "data_dtype": t.data.dtype.str}
        for t in reader.tensors if not (arch == "llama" and t.name == _ROPE_FREQS)  # read into the config
    ]
    return {"architecture": arch, "tensors": tensors}


def _convert_metadata(path: Path, reader, arch: str, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.architectures = [ARCHITECTURES[arch]]
    for key, name in _METADATA.get(arch, {}).items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None and not (name == "sliding_window" and value == 0):  # 0: no window
            setattr(config, name, value)
    if arch in _GEMMA_27B_BLOCKS:
        heads = config.num_attention_heads
        wide = config.num_hidden_layers == _GEMMA_27B_BLOCKS[arch]
        config.query_pre_attn_scalar = config.hidden_size // heads if wide else config.head_dim
    _linear_rope_scaling(reader, arch, config)
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if arch == "llama" and freqs is not None:
        config.rope_parameters = _llama3_rope(config, np.asarray(freqs.data, dtype=np.float32).reshape(-1))
    config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out)
    if config.eos_token_id is not None:
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(out)


def _linear_rope_scaling(reader, arch: str, config) -> None:
    """Linear RoPE scaling as llama.cpp writes it (`<arch>.rope.scaling.type` and `.factor`: Gemma 3
    4B and larger on their global layers), which transformers' reader drops. Another kind (YaRN...)
    is refused by name rather than run without it."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return
    if kind != "linear":
        raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported; supported: none, linear (and Llama 3's rope_freqs)")
    scaled = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    params = dict(config.rope_parameters)
    if arch == "gemma3":  # only the global layers are scaled; the sliding ones keep their own base
        params["full_attention"] = {**params["full_attention"], **scaled}
    else:
        params.update(scaled)
    config.rope_parameters = params


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp's converter computes them:
    1 for wavelengths under original/high, `factor` over original/low, and between them the
    divisor of the interpolation transformers applies."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    wavelen = 2 * np.pi / inv.astype(np.float64)
    smooth = (original / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, middle)).astype(np.float32)


def _llama3_rope(config, freqs: np.ndarray) -> dict:
    """The `rope_parameters` (type llama3) whose divisors are the file's `rope_freqs` tensor. Its
    factor is the largest divisor; the low/high frequency factors are Meta's 1 and 4 (every Llama
    3.x, and the converter's defaults), and the original context is solved from an interpolated
    divisor (else the converter's default 8192). Refused unless they give the tensor back."""
    theta = config.rope_parameters.get("rope_theta", 10000.0) if config.rope_parameters else 10000.0
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor, low, high = float(freqs.max()), 1.0, 4.0
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    candidates = [8192]
    for f, freq in zip(freqs.tolist(), inv.tolist()):
        if 1.0 < f < factor:  # interpolated: 1/f = (1 - s)/factor + s, s = (original/wavelen - low)/(high - low)
            s = (1 / f - 1 / factor) / (1 - 1 / factor)
            candidates.append(round(2 * np.pi / freq * (low + s * (high - low))))
    for original in candidates:
        if len(freqs) == len(inv) and np.allclose(_llama3_factors(theta, dim, factor, low, high, original), freqs,
                                                  rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(f"GGUF tensor {_ROPE_FREQS!r} is not Llama 3 RoPE scaling with low/high frequency "
                     "factors 1 and 4; such a file is not supported")


def gguf_tensors(path: Path, folder: Path) -> Iterator[GGUFWeight]:
    """Every tensor of the file in its stored layout (memory-mapped, nothing copied), named as
    Hugging Face names it, through the index `sidecar_folder` wrote into `folder`."""
    index = json.loads((folder / INDEX).read_text())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for t in index["tensors"]:
        dtype = np.dtype(t["data_dtype"])
        size = int(np.prod(t["data_shape"])) * dtype.itemsize
        data = mapped[t["offset"]:t["offset"] + size].view(dtype).reshape(t["data_shape"])
        yield GGUFWeight(t["name"], t["kind"], tuple(t["shape"]), data)


def _hf_name(name: str, blocks: dict[str, str]) -> str:
    stem, _, kind = name.rpartition(".")  # kind: weight or bias
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in blocks:
        return f"model.layers.{parts[1]}.{blocks[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no place in this model")


def gguf_weights(path: Path, hf_config, keep: frozenset[str] = frozenset(),
                 skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) one at a time, undoing what llama.cpp's converter did:
    it interleaves Llama's Q and K rows (and biases) for its RoPE, stores Gemma's norms as 1 + weight,
    stacks each projection of all experts into one tensor and squeezes [1, n] tensors to [n].
    Tensors named in `keep` come as stored instead: uint8 rows of blocks, one row per output
    feature (so row permutations and row shards apply to them as to floats). Tensors `skip` names
    (another pipeline stage's) are not decoded."""
    folder = sidecar_folder(path)
    arch = json.loads((folder / INDEX).read_text())["architecture"]
    for weight in gguf_tensors(path, folder):
        if skip is not None and skip(weight.name):
            continue
        if weight.name in keep:
            tensor = torch.from_numpy(np.array(weight.data, dtype=np.uint8).reshape(weight.shape[0], -1))
        else:
            tensor = weight.dequantize()
        if arch == "llama" and weight.name.endswith(_ROPE_PERMUTED):
            heads = hf_config.num_attention_heads if "q_proj" in weight.name else hf_config.num_key_value_heads
            tensor = _unpermute_rope_rows(tensor, heads)
        elif arch in ("gemma2", "gemma3") and weight.name.endswith("norm.weight"):
            tensor = tensor - 1
        elif weight.name.endswith("shared_expert_gate.weight"):
            tensor = tensor.reshape(1, -1)  # the converter squeezes [1, n] tensors
        if STACKED_EXPERTS.search(weight.name):
            # one tensor per expert, under the names the model files place in their stacked experts
            for expert, one in enumerate(tensor):
                yield weight.name.replace(".experts.", f".experts.{expert}."), one
            continue
        yield weight.name, tensor


_ROPE_PERMUTED = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
STACKED_EXPERTS = re.compile(r"\.experts\.(gate|up|down)_proj\.weight$")


def _unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows were stored as (pairs, 2) interleaved; Hugging Face keeps (2, half)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
