"""The demo tokenizer as a plain byte-level one: its FIM tokens renamed to unused ones."""
from __future__ import annotations

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def without_fim_tokens(text: str) -> str:
    """A tokenizer file's text (tokenizer.json, tokenizer_config.json, special_tokens_map.json)
    with the FIM tokens renamed; ids stay, so a checkpoint's vocabulary size holds."""
    for i, token in enumerate(FIM_TOKENS):
        text = text.replace(token, f"<|unused_{i}|>")
    return text
