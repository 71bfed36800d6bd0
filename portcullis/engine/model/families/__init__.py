"""Model implementations, chosen by the `architectures` field of a checkpoint's config.json.

Each family lives in its own module and names the architectures it serves; the module is
imported only when a checkpoint asks for one of them.
"""
from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module under portcullis.engine.model.families, class name)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    **{name: ("llama", "LlamaForCausalLM") for name in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        # The same decoders saved without their LM head (embedding checkpoints).
        "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model",
    )},
    **{name: ("gemma", "GemmaForCausalLM") for name in (
        "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    )},
    **{name: ("moe_decoder", "MoeForCausalLM") for name in (
        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    )},
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
}


def model_class(hf_config) -> type[nn.Module]:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            module, cls = ARCHITECTURES[name]
            return getattr(importlib.import_module(f"portcullis.engine.model.families.{module}"), cls)
    raise ValueError(
        f"model architecture {names or '(none given in config.json)'} is not supported; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )
