"""A GGUF file from a random-weight test checkpoint, written the way llama.cpp's converter
(`convert_hf_to_gguf.py`) writes one, so the engine's GGUF loader is tested on the layout real files
have: the architecture's metadata keys, the byte-level BPE vocabulary, and the tensors under GGUF
names with the converter's changes (Llama-family Q/K rows interleaved for llama.cpp's RoPE, Gemma
norms stored as 1 + w, experts stacked [experts, rows, columns], [1, n] tensors squeezed).

`quantized=True` stores the matrices as llama.cpp's Q8_0 (embeddings, output, attention) and Q4_0
(feed-forward and experts) where their rows are whole 32-value blocks; norms, biases and routers stay
F32, as llama-quantize leaves them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.numpy import load_file

# Hugging Face model_type -> llama.cpp's architecture (Mistral and Mixtral are written as "llama").
GGUF_ARCH = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma": "gemma", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "phi3": "phi3",
}
# What a GGUF file cannot hold, per test kind (llama.cpp stores it nowhere, or this writer does not
# write it): a test checkpoint built with these overrides reads back as the model it was. (What
# llama.cpp writes and transformers' reader drops, the engine reads itself: `_METADATA` in
# portcullis/engine/model/gguf_checkpoint.py.)
GGUF_ROUND_TRIP = {
    "llama": {},  # its llama3 RoPE scaling is the rope_freqs tensor
    "mistral": {},  # read back as Llama (the same decoder; its 4096-token window is past max_model_len)
    "qwen2": {},
    "qwen3": {},
    # no untied head in llama.cpp's gemma2; it stores no query_pre_attn_scalar and uses the head size
    "gemma2": dict(tie_word_embeddings=True, query_pre_attn_scalar=32),
    # llama.cpp's layer pattern (5 sliding, 1 full); its global layers keep their linear RoPE scaling
    "gemma3": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32),
    "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),  # LongRoPE: factor tensors not written here
    "qwen2_moe": {},
    "qwen3_moe": dict(mlp_only_layers=[]),  # dense layers unknown to llama.cpp
    "mixtral": {},  # transformers reads a "llama" file with experts as a dense Llama: unsupported
}

_GEMMA = ("gemma", "gemma2", "gemma3")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_Q8 = gguf.GGMLQuantizationType.Q8_0
_Q4 = gguf.GGMLQuantizationType.Q4_0


def write_gguf(folder: Path, out: Path, quantized: bool = False) -> Path:
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    _metadata(writer, config, arch, quantized)
    _tokenizer(writer, folder, config)
    for name, array in _tensors(folder, config, arch):
        _add_tensor(writer, name, array, quantized)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return params.get("rope_theta", config.get("rope_theta", 10000.0))


def _metadata(writer: gguf.GGUFWriter, config: dict, arch: str, quantized: bool) -> None:
    # transformers reads a file named exactly "mistral" as Mistral, which gguf-py then has no
    # tensor names for; llama.cpp names a file after its folder ("Mistral-7B-...")
    writer.add_name(f"{config['model_type']}-test")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(_rope_theta(config))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if experts := config.get("num_local_experts") or config.get("num_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if shared := config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(shared)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma3" and (full := config["rope_parameters"]["full_attention"]).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # llama.cpp writes the global layers' scaling
        writer.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        params = config.get("rope_parameters") or {}
        writer.add_rope_scaling_orig_ctx_len(params.get("original_max_position_embeddings", config.get(
            "original_max_position_embeddings", config["max_position_embeddings"])))
        writer.add_rope_dimension_count(head_dim)
        writer.add_sliding_window(config.get("sliding_window") or 0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if quantized else gguf.LlamaFileType.ALL_F32)


def _tokenizer(writer: gguf.GGUFWriter, folder: Path, config: dict) -> None:
    """Byte-level BPE as llama.cpp stores it: every token by id (padded to the model's vocabulary),
    its type (control for special added tokens), the merges as "a b" strings, the special ids."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for token, index in vocab.items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in spec["added_tokens"]:
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if (token := tokenizer_config.get(key)) in vocab:
            add(vocab[token])
    if template := tokenizer_config.get("chat_template"):
        writer.add_chat_template(template)


def _tensors(folder: Path, config: dict, arch: str):
    """(GGUF name, array) in the converter's layout."""
    weights: dict[str, np.ndarray] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    names = gguf.get_tensor_name_map(_arch_enum(arch), config["num_hidden_layers"])
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, array in weights.items():
        array = array.astype(np.float32)
        if (match := _EXPERT.fullmatch(name)) is not None:
            layer, expert, proj = match.groups()
            experts.setdefault((int(layer), _EXPERT_PART[proj]), {})[int(expert)] = array
            continue
        if name == "lm_head.weight" and arch in _GEMMA:
            continue  # llama.cpp's Gemma files always share the embedding
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            array = _interleave_rope_rows(array, heads)
        if arch in _GEMMA and name.endswith("norm.weight"):
            array = array + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name!r} in {arch}")
        yield gguf_name, array.squeeze() if array.ndim > 1 else array
    for (layer, part), by_expert in sorted(experts.items()):
        yield f"blk.{layer}.ffn_{part}_exps.weight", np.stack([by_expert[e] for e in sorted(by_expert)])
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if arch == "llama" and params.get("rope_type", params.get("type")) == "llama3":
        yield "rope_freqs.weight", _llama3_rope_freqs(config, params)


def _llama3_rope_freqs(config: dict, params: dict) -> np.ndarray:
    """Llama 3 RoPE scaling as one divisor per frequency, as the converter writes it (llama.cpp
    divides each frequency by its own). The converter reads the original context from the top level
    of config.json (8192 if absent, as in Meta's files); this checkpoint keeps it in rope_parameters."""
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    factor, low, high = params.get("factor", 8.0), params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings", 8192))
    wavelengths = 2 * torch.pi * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    divisors = []
    for wavelength in wavelengths.tolist():
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            mix = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - mix) / factor + mix))
    return np.array(divisors, dtype=np.float32)


def _arch_enum(arch: str) -> gguf.MODEL_ARCH:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _interleave_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows (2, half) become (half, 2): llama.cpp's RoPE rotates adjacent pairs."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, quantized: bool) -> None:
    qtype = _quant_type(name, array) if quantized else None
    if qtype is None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def _quant_type(name: str, array: np.ndarray) -> gguf.GGMLQuantizationType | None:
    if array.ndim < 2 or array.shape[-1] % 32 or ".ffn_gate_inp" in name:
        return None
    return _Q4 if ".ffn_" in name else _Q8
