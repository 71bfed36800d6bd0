"""Gemma, Gemma 2 and Gemma 3 (text-only) decoders, told apart by their config's `model_type`.

What sets them apart from the Llama family: RMSNorm scaling by (1 + w), embeddings scaled by
sqrt(hidden_size) in the model's dtype, a GeGLU MLP (tanh-approximated GELU) and a tied head.
Gemma 2 and 3 add a norm after attention and around the MLP (four per layer), an attention
scale from `query_pre_attn_scalar`, and `layer_types` interleaving sliding-window and full
attention. Gemma 2 soft-caps attention scores and the final logits (c * tanh(x / c)); Gemma 3
instead normalises queries and keys per head and gives each layer type its own RoPE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from portcullis.engine.distributed import divide, tp_size
from portcullis.engine.model.attention import AttentionMetadata
from portcullis.engine.model.families.llama import (
    Attention,
    LlamaForCausalLM,
    head_dim_of,
    own_layers,
    rope_frequencies,
    stage_modules,
)
from portcullis.engine.model.layers import (
    MergedColumnParallelLinear,
    MissingLayer,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)

# Layer types of `layer_types`; Gemma 3 keys its RoPE parameters by them.
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 3's RoPE bases where a config predates per-layer-type `rope_parameters`.
LEGACY_THETA = {SLIDING: ("rope_local_base_freq", 10_000.0), FULL: ("rope_theta", 1_000_000.0)}
# hidden activation -> F.gelu's `approximate`
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_python_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), all in float32 before the cast back, as Gemma does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _sandwich_norms(cfg) -> bool:
    """Gemma 2 and 3 normalise each block's output as well as its input."""
    return cfg.model_type != "gemma"


def rope_for(cfg, layer_type: str, max_positions: int) -> RotaryEmbedding:
    """The rotary table of one layer type: Gemma 3 keeps RoPE parameters per layer type."""
    with torch.device("cpu"):  # real tensors even while the model is being built on `meta`
        inv_freq, scaling = _inv_freq(cfg, layer_type)
    return RotaryEmbedding(inv_freq, scaling, max_positions)


def _inv_freq(cfg, layer_type: str) -> tuple[torch.Tensor, float]:
    params = getattr(cfg, "rope_parameters", None) or {}
    if cfg.model_type != "gemma3_text":
        return rope_frequencies(cfg)  # one RoPE for every layer, as Llama's
    if layer_type in params:
        params = params[layer_type]
    else:  # a config read by transformers 4.x: rope_theta (full) and rope_local_base_freq (sliding)
        name, default = LEGACY_THETA[layer_type]
        scaling = (getattr(cfg, "rope_scaling", None) or {}) if layer_type == FULL else {}
        params = {"rope_type": "default", **scaling, "rope_theta": getattr(cfg, name, None) or default}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", "linear"):
        dim = head_dim_of(cfg)
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return (inv / params["factor"] if rope_type == "linear" else inv), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in ("dynamic", "longrope"):
        raise ValueError(f"Gemma 3 RoPE type {rope_type!r} for {layer_type} layers is not supported")
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), layer_type=layer_type)


def layer_type_of(cfg, layer: int) -> str:
    layer_types = getattr(cfg, "layer_types", None)
    return layer_types[layer] if layer_types else FULL


class GemmaAttention(Attention):
    """Llama's attention with Gemma's norms (Gemma 3 norms Q and K per head), its query scale
    `query_pre_attn_scalar` and Gemma 2's score soft-capping."""

    norm = GemmaRMSNorm
    qk_norm_types = ("gemma3_text",)

    def score_options(self, cfg) -> dict:
        scalar = getattr(cfg, "query_pre_attn_scalar", None) or head_dim_of(cfg)  # Gemma 1 scales by head_dim
        return {"scale": scalar**-0.5, "softcap": getattr(cfg, "attn_logit_softcapping", None)}


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu(gate(x)) * up(x))."""

    def __init__(self, cfg):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size)
        self.inter = divide(inter, tp_size())
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported for Gemma (supported: {', '.join(ACTIVATIONS)})")
        self.approximate = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer, rope)
        self.mlp = GemmaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.sandwich = _sandwich_norms(cfg)
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.sandwich:  # Gemma 1: Llama's pre-norm residual blocks
            h = h + self.self_attn(positions, self.input_layernorm(h), meta)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, cfg, max_positions: int):
        super().__init__()
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an encoder, e.g. EmbeddingGemma) is not supported")
        ropes = {t: rope_for(cfg, t, max_positions) for t in sorted({layer_type_of(cfg, i) for i in range(cfg.num_hidden_layers)})}
        # sqrt(hidden) rounded to the model's dtype first, as transformers does (55.4256 is 55.5 in bf16).
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32, device="cpu")  # real, even under `meta`
        self.embed_scale = float(scale.to(torch.get_default_dtype()))
        self.embed_tokens, self.layers, self.norm = stage_modules(
            cfg, lambda i: GemmaDecoderLayer(cfg, i, ropes[layer_type_of(cfg, i)]),
            lambda: VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size),
            lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.own = own_layers(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """As `LlamaModel.forward`, for one pipeline stage."""
        h = self.embed_tokens(input_ids) * self.embed_scale if hidden is None else hidden
        for layer in self.own:
            h = layer(positions, h, meta)
        return h if isinstance(self.norm, MissingLayer) else self.norm(h)


class GemmaForCausalLM(LlamaForCausalLM):
    """The causal LM for Gemma, Gemma 2 and Gemma 3 text checkpoints: `forward` gives hidden
    states, `compute_logits` the chosen rows' logits (soft-capped where the config says)."""

    decoder = GemmaModel
    ties_by_default = True

    def __init__(self, cfg, max_positions: int, lm_head: bool = True):
        super().__init__(cfg, max_positions, lm_head)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
