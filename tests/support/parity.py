"""Reference greedy generations from Hugging Face transformers, computed once per model per session."""
from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

PROMPT_LENGTHS = (1, 7, 16, 17, 33, 64, 150, 300)
NEW_TOKENS = 32


def parity_prompts(vocab_size: int = 4096, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@functools.cache
def hf_greedy(model_dir: Path, prompts: tuple[tuple[int, ...], ...], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """`generate(do_sample=False)` prompt by prompt (no padding), never stopping early."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )
            outs.append(gen[0, len(prompt):].tolist())
    return outs
