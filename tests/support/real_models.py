"""The real checkpoints of the tests (`make setup` fetches them) and the prompts they are asked,
fixed before any output was seen: chat turns for SmolLM2-135M-Instruct, plain text for Gemma 3 270M
(a base model)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from portcullis.engine.assets import SMOLLM2, RealModel, cached

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Complete this Python function:\ndef fibonacci(n):",
    "List three primary colors.",
]
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n",
    "Water boils at a temperature of",
]


def real_file(model: RealModel) -> Path:
    path = cached(model)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{model.file} is not in the cache: `make setup` fetches it (tools/fetch_models.py)")
        pytest.skip(f"{model.file} not fetched: run `make setup`")
    return path


def prompts_for(model: RealModel, tokenizer) -> list[list[int]]:
    if model is SMOLLM2:
        return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for c in CHATS]
    return [tokenizer(p).input_ids for p in PLAIN]
