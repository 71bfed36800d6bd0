"""The real checkpoints of the tests (`make setup` fetches them), the prompts they are asked,
fixed before any output was seen: chat turns for SmolLM2-135M-Instruct, plain text for Gemma 3 270M
(a base model), and transformers' answers to them (`reference`, made once per session: reading a
GGUF file costs transformers 10-60 s)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from portcullis.engine.assets import SMOLLM2, RealModel, cached

NEW_TOKENS = 16
TOP = 5

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


@dataclass
class Reference:
    source: Path  # the GGUF file
    folder: Path  # the same weights as a Hugging Face folder (safetensors, float32), written by transformers
    prompts: list[list[int]]
    outputs: list[tuple[list[int], list[dict[int, float]]]]  # greedy ids, each step's top-5 logprobs


def transformers_reference(model: RealModel, folder: Path) -> Reference:
    """transformers on the GGUF file (it reads the file itself; float32): greedy ids to its
    end-of-sequence token or NEW_TOKENS, each step's top-5 logprobs, and the model it read saved
    as a Hugging Face folder. The tokenizer is the engine's (converted from the same file)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portcullis.engine.model.gguf_checkpoint import sidecar_folder

    path = real_file(model)
    tokenizer = AutoTokenizer.from_pretrained(sidecar_folder(path))
    prompts = prompts_for(model, tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=hf.config.pad_token_id or 0)
            tops = []
            for scores in gen.scores:
                values, indices = torch.log_softmax(scores[0].float(), -1).topk(TOP)
                tops.append(dict(zip(indices.tolist(), values.tolist())))
            outputs.append((gen.sequences[0, len(prompt):].tolist(), tops))
    hf.hf_quantizer = None  # transformers refuses to save a model it dequantized from GGUF otherwise
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Reference(path, folder, prompts, outputs)
