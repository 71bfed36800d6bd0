"""One Llama-style decoder covering Llama, Mistral, Qwen2/2.5 and Qwen3 by their config flags.

Flags read from the Hugging Face config: QKV bias (Qwen2, Llama's `attention_bias`), Q/K RMSNorm
(Qwen3), tied embeddings, RoPE scaling, sliding-window layers and an explicit `head_dim`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from portcullis.engine.distributed import (
    divide,
    is_first_stage,
    is_last_stage,
    stage_layers,
    tp_size,
)
from portcullis.engine.model.attention import AttentionMetadata, PagedAttention
from portcullis.engine.model.layers import (
    MergedColumnParallelLinear,
    MissingLayer,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    normed_matmul,
    residual_matmul,
)
from portcullis.kernels import cpu_decode, cpu_stack, torch_attention


def rope_frequencies(cfg, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them for
    sequences of up to `max_positions` tokens."""
    with torch.device("cpu"):  # real tensors even while the model is being built on `meta`
        return _rope_frequencies(cfg, max_positions)


def _rope_frequencies(cfg, max_positions: int | None) -> tuple[torch.Tensor, float]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:  # configs read by transformers 4.x keep the legacy top-level fields
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        dim = head_dim_of(cfg)
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise ValueError("RoPE scaling type 'dynamic' is not supported (supported: default, linear, llama3, yarn, longrope)")
    if rope_type == "longrope":
        _check_longrope_length(cfg, params, max_positions)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))


def _check_longrope_length(cfg, params: dict, max_positions: int | None) -> None:
    """transformers switches LongRoPE from its short to its long factors for a whole forward pass once
    that pass reaches past `original_max_position_embeddings`, so keys already cached keep the short
    rotation: a paged engine cannot reproduce that. Below the limit only the short factors apply, and
    there we match it exactly."""
    original = params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    if original is None or max_positions is None or max_positions > original:
        raise ValueError(
            f"LongRoPE (rope_type 'longrope') is supported only up to the model's original context of "
            f"{original} tokens (original_max_position_embeddings), where its short factors apply; "
            f"max_model_len is {max_positions}: set --max-model-len to at most {original}"
        )


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_window_of(cfg, layer: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


class Attention(nn.Module):
    norm: type[nn.Module] = RMSNorm  # of the per-head Q/K norms, where the family has them
    qk_norm_types = ("qwen3", "qwen3_moe")  # the config `model_type`s that norm Q and K per head

    def __init__(self, cfg, layer: int, rope: RotaryEmbedding):
        super().__init__()
        hd = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", False)
        qkv_bias = bias or cfg.model_type == "qwen2" or getattr(cfg, "qkv_bias", False)  # Qwen2-MoE's flag
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads, qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias)
        self.q_size = self.qkv_proj.num_heads * hd
        self.kv_size = self.qkv_proj.num_kv_heads * hd
        self.head_dim = hd
        self.qk_norm = cfg.model_type in self.qk_norm_types
        if self.qk_norm:
            self.q_norm = self.norm(hd, cfg.rms_norm_eps)
            self.k_norm = self.norm(hd, cfg.rms_norm_eps)
        self.rope = rope
        self.attn = PagedAttention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, sliding_window_of(cfg, layer),
                                   **self.score_options(cfg))

    def score_options(self, cfg) -> dict:
        """PagedAttention's `scale` and `softcap` where a family departs from head_dim**-0.5, uncapped."""
        return {}

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), meta))

    def add_to(self, h: torch.Tensor, norm: RMSNorm, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``h + forward(positions, norm(h), meta)``, the norm and residual fused into the projections
        where the kernels allow (`normed_matmul`, `residual_matmul`)."""
        return residual_matmul(self.o_proj, self.attend(positions, normed_matmul(norm, self.qkv_proj, h), meta), h)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention rows ``[tokens, heads * head_dim]`` for the fused Q, K, V projections."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.q_size // self.head_dim, self.head_dim)
        k = k.reshape(-1, self.kv_size // self.head_dim, self.head_dim)
        v = v.reshape(-1, self.kv_size // self.head_dim, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        return self.attn(q, k, v, meta).reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias)
        self.inter = divide(inter, tp_size())
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (only silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_up_proj(x)))

    def add_to(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``h + forward(norm(h))``, the norm and residual fused into the projections where the
        kernels allow."""
        return residual_matmul(self.down_proj, self._act(normed_matmul(norm, self.gate_up_proj, h)), h)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up. Where the projections are native (GGUF blocks on a CPU), the decode
        stack's one pass over the rows: a prefill's rows are megabytes, which PyTorch's two ops
        read and write three times (2,048 rows: 2.4 against 1.2 ms held to AVX2)."""
        if (self.gate_up_proj.quantized is not None and gate_up.dtype == torch.float32 and gate_up.dim() == 2
                and gate_up.is_contiguous()):
            act = cpu_stack.silu_mul(gate_up)
            if act is not None:
                return act
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, layer, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn.add_to(h, self.input_layernorm, positions, meta)
        if isinstance(self.mlp, MLP):
            return self.mlp.add_to(h, self.post_attention_layernorm)
        return h + self.mlp(self.post_attention_layernorm(h))  # a mixture of experts


def stage_modules(cfg, layer: Callable[[int], nn.Module], embedding: Callable[[], nn.Module],
                  norm: Callable[[], nn.Module]) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """The embedding, layers and final norm of this pipeline stage, `MissingLayer` where another
    stage holds the part (`distributed.stage_layers`): each stage builds only its own."""
    own = stage_layers(cfg.num_hidden_layers)
    layers = nn.ModuleList(layer(i) if i in own else MissingLayer() for i in range(cfg.num_hidden_layers))
    return (embedding() if is_first_stage() else MissingLayer()), layers, (norm() if is_last_stage() else MissingLayer())


def own_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers this pipeline stage runs, in order."""
    return [layer for layer in model.layers if not isinstance(layer, MissingLayer)]


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage (the whole model at one stage): `forward` takes the
    token ids on the first stage and the previous stage's hidden states on the others, and gives
    the final norm's output on the last stage, its own hidden states on the others."""

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_frequencies(cfg, max_positions)
        rope = RotaryEmbedding(inv_freq, scaling, max_positions)
        self.embed_tokens, self.layers, self.norm = stage_modules(
            cfg, lambda i: DecoderLayer(cfg, i, rope), lambda: VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.own = own_layers(self)  # a plain list: the ModuleList registers them

        self._stack: cpu_stack.DecodeStack | None | bool = None  # None: not tried yet; False: not this model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        if (stack := self._decode_stack(h, positions, meta)) is not None:
            b = meta.batch
            h = stack.run(h, positions, meta.slot_mapping, b.block_tables, b.context_lens)
        else:
            for layer in self.own:
                h = layer(positions, h, meta)
        return h if isinstance(self.norm, MissingLayer) else self.norm(h)

    def _decode_stack(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """The native stack (`kernels.cpu_stack`) where this step is all decodes (one new token per
        sequence) on a model it runs: the same kernels as the layer-by-layer path, one call."""
        b = meta.batch
        if (self._stack is False or b.max_query_len != 1 or len(h) != len(b.block_tables) or meta.other_groups
                or h.dtype != torch.float32 or not cpu_stack.ENABLED or not torch_attention.NATIVE_DECODE):
            return None
        if self._stack is None or not self._stack.bound_to(self._caches()):
            self._stack = _build_stack(self) or False
            if self._stack is False:
                return None
        steady = (positions.dtype == meta.slot_mapping.dtype == torch.int64 and b.block_tables.dtype == torch.int32
                  and b.context_lens.dtype == torch.int32 and b.block_tables.is_contiguous()
                  and b.context_lens.is_contiguous() and positions.is_contiguous() and meta.slot_mapping.is_contiguous()
                  and h.is_contiguous())
        if not steady:
            return None
        self.own[0].self_attn.rope.check_positions(positions)  # as the layer-by-layer path would
        return self._stack

    def _caches(self) -> list:
        return [layer.self_attn.attn.kv_cache for layer in self.own]


def _build_stack(model: LlamaModel) -> cpu_stack.DecodeStack | None:
    """The native decode stack for `model`, or None where a layer is not what it runs: Llama's own
    layer classes (no family subclass), every projection GGUF blocks without bias (kept so at TP=1
    only), no Q/K norm or soft-cap, one norm epsilon, float32 or bf16 caches the decode kernel reads
    (one dtype), one KV-cache group."""
    first = model.own[0]
    paged, rope, eps = first.self_attn.attn, first.self_attn.rope, first.input_layernorm.eps
    if rope.cos.dtype != torch.float32 or not (rope.cos.is_contiguous() and rope.sin.is_contiguous()):
        return None
    layers = []
    for layer in model.own:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP
                or any(type(norm) is not RMSNorm or norm.eps != eps for norm in norms)
                or attn.qk_norm or attn.rope is not rope or attn.attn.softcap is not None or attn.attn.kv_group
                or attn.attn.scale != paged.scale or attn.attn.kv_cache is None):
            return None
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(p.quantized is None or p.bias is not None for p in projections):
            return None
        key_cache, value_cache = attn.attn.kv_cache
        if not (key_cache.dtype == value_cache.dtype == paged.kv_cache[0].dtype
                and key_cache.dtype in cpu_decode.CACHE_DTYPES and key_cache.device.type == "cpu"
                and key_cache.shape[3] in cpu_decode.HEAD_DIMS and key_cache.is_contiguous()
                and value_cache.is_contiguous()):
            return None
        layers.append(cpu_stack.StackLayer(
            norms[0].weight.data, norms[1].weight.data, tuple((p.weight.data, p.quantized.kind) for p in projections),
            key_cache, value_cache, attn.attn.sliding_window))
    return cpu_stack.decode_stack(layers, q_heads=paged.num_heads, kv_heads=paged.num_kv_heads,
                                  head_dim=paged.head_dim, inter=first.mlp.inter, eps=eps, scale=paged.scale,
                                  cos=rope.cos, sin=rope.sin)


class LlamaForCausalLM(nn.Module):
    """The causal LM: `forward` gives hidden states, `compute_logits` the chosen rows' logits.
    Without `lm_head` (a pooling runner) it only gives hidden states."""

    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    decoder: type[nn.Module] = LlamaModel  # a family with other layers names its own
    ties_by_default = False  # what a config without `tie_word_embeddings` means

    def __init__(self, cfg, max_positions: int, lm_head: bool = True):
        super().__init__()
        self.model = self.decoder(cfg, max_positions)
        # Tied: the checkpoint has no head, the embedding's table is it (loaded into the head on a
        # last pipeline stage that lacks the embedding, shared where one stage holds both).
        self.tie_word_embeddings = lm_head and bool(getattr(cfg, "tie_word_embeddings", self.ties_by_default))
        self.lm_head = None
        if lm_head:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if is_last_stage() else MissingLayer()
        if self.shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def shares_embedding(self) -> bool:
        """The head is the embedding's own parameter: tied, and both on this stage."""
        return self.tie_word_embeddings and is_first_stage() and is_last_stage()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in own_layers(self.model)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after this stage's layers; `hidden` is the previous stage's (None on the first)."""
        return self.model(input_ids, positions, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
