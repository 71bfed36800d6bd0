"""Model implementations, chosen by the `architectures` field of a checkpoint's config.json."""
from __future__ import annotations

from torch import nn

from portcullis.engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM


def model_class(hf_config) -> type[nn.Module]:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return LlamaForCausalLM
    raise ValueError(
        f"model architecture {names or '(none given in config.json)'} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
