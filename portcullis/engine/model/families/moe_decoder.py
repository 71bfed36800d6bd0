"""Llama-style decoders whose MLPs are mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention, norms and embeddings are llama.py's (Qwen2-MoE's QKV bias and Qwen3-MoE's Q/K norm by
their config flags); each sparse layer's MLP is a `SparseMoeBlock`. Qwen's `mlp_only_layers` and
`decoder_sparse_step` keep some layers dense.
"""
from __future__ import annotations

from portcullis.engine.model.families.llama import MLP, LlamaForCausalLM
from portcullis.engine.model.families.moe import SparseMoeBlock, expert_weight_target


def is_sparse_layer(cfg, layer: int) -> bool:
    if cfg.model_type == "mixtral":
        return True
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0 and (layer + 1) % step == 0


def sparse_block(cfg) -> SparseMoeBlock:
    shared = getattr(cfg, "shared_expert_intermediate_size", 0)
    return SparseMoeBlock(cfg, MLP(cfg, shared) if shared else None)


class MoeForCausalLM(LlamaForCausalLM):
    """llama.py's causal LM with each sparse layer's dense MLP replaced by the experts (built on the
    meta device, so the dense MLP it replaces never held memory)."""

    def __init__(self, cfg, max_positions: int, lm_head: bool = True):
        super().__init__(cfg, max_positions, lm_head)
        for i, layer in enumerate(self.model.layers):
            if is_sparse_layer(cfg, i) and layer in self.model.own:  # not another pipeline stage's
                layer.mlp = sparse_block(cfg)

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """Where a checkpoint tensor goes when the packed-module names do not say: one expert's
        projection into the stacked experts, Mixtral's `block_sparse_moe` router into `mlp`."""
        target = expert_weight_target(name)
        if target is None and ".block_sparse_moe." in name:
            target = name.replace(".block_sparse_moe.", ".mlp."), None
        return target
