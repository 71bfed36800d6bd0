"""Phi-3: a Llama-style decoder whose checkpoints store Q/K/V as one `qkv_proj` and gate/up as one
`gate_up_proj`. The names match llama.py's fused layers; their weight loaders split a fused
checkpoint tensor into its parts before taking this rank's shard of each, so any TP size is right.

RoPE is the default one or LongRoPE; LongRoPE only up to `original_max_position_embeddings`, where
transformers applies its short factors (llama.py's `rope_frequencies` says why and refuses more).
"""
from __future__ import annotations

from portcullis.engine.model.families.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, max_positions: int, lm_head: bool = True):
        params = getattr(cfg, "rope_parameters", None) or {}
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}, e.g. Phi-4-mini) "
                             f"are not supported; Phi-3 models rotate whole heads")
        super().__init__(cfg, max_positions, lm_head)
