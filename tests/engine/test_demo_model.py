"""The shipped demo model loads with transformers unchanged and writes Python, not noise."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from engine.assets import DEMO_MODEL_DIR

# Fifteen rather than a handful: one batch costs little more, and a pass rate over more
# prompts does not flip when one greedy continuation changes on another CPU or torch build.
PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "def read_lines(path):\n    with open(path) as f:",
    "for i in range(10):",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x",
    "try:\n    import json\nexcept ImportError:",
    "def count_words(text):\n    counts = {}\n    for word in text.split():",
    "def is_even(n):\n    if n % 2 == 0:",
    "import re\n\n\ndef parse_version(text):",
    'class Config:\n    """Settings read from a file."""\n\n    def __init__(self, path):',
    "def main(argv=None):\n    parser = argparse.ArgumentParser()",
    "def _check_name(name):\n    if not isinstance(name, str):",
    "class Error(Exception):",
    "def join_path(a, *parts):",
)
NEW_TOKENS = 48
# Fewer new lines than this and an empty or one-line continuation would pass for free.
MIN_NEW_LINES = 2


def complete_lines(prompt: str, continuation: str) -> str | None:
    """Prompt plus the continuation's complete lines, or None if it adds too few of them."""
    text = prompt + continuation
    cut = text[: text.rfind("\n") + 1] if "\n" in continuation else ""
    added = cut[len(prompt) :].splitlines()
    return cut if sum(bool(line.strip()) for line in added) >= MIN_NEW_LINES else None


def closers(text: str) -> list[str]:
    """Ways to finish a cut that stopped inside a block or a docstring."""
    last = next(line for line in reversed(text.splitlines()) if line.strip())
    indent = last[: len(last) - len(last.lstrip())]
    return ["", f"{indent}    pass\n", f"{indent}pass\n", '"""\n', "'''\n", ')\n', ']\n', '}\n']


def is_python(prompt: str, continuation: str) -> bool:
    text = complete_lines(prompt, continuation)
    if text is None:
        return False
    for closer in closers(text):
        try:
            ast.parse(text + closer)
            return True
        except SyntaxError:
            continue
    return False


def continuations(model: LlamaForCausalLM, tokenizer, prompts=PROMPTS) -> list[str]:
    """Greedy continuations of all prompts in one left-padded batch: one decode loop."""
    tokenizer.padding_side = "left"
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    new = generated[:, batch.input_ids.shape[1] :]
    return tokenizer.batch_decode(new, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def test_folder_is_a_small_llama() -> None:
    names = {p.name for p in DEMO_MODEL_DIR.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "README.md"}
    assert expected <= names
    assert sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir()) < 20_000_000


def test_tokenizer_round_trips_python_source(tokenizer) -> None:
    source = Path(ast.__file__).read_text(encoding="utf-8")
    unicode = 'def grüße(名前: str) -> str:\n\treturn f"héllo {名前} 🐍 — ok"\r\n'
    for text in (source, unicode, "    \n\n  x=1  ", ""):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens(tokenizer, model) -> None:
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert len(tokenizer) == model.config.vocab_size
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.encode(token) == [tokenizer.convert_tokens_to_ids(token)]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in model.generation_config.eos_token_id


def test_chat_template_adds_generation_prompt(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not without.endswith("assistant\n")


def test_checker_rejects_empty_and_garbage() -> None:
    assert is_python("def f(x):", "\n    y = x + 1\n    return y\n")
    assert is_python("def f(x):", '\n    """Return the\n    thing.\n')
    assert not is_python("def f(x):", "")
    assert not is_python("def f(x):", "\n    return x")
    assert not is_python("def f(x):", "\n    ) x = = (\n    return y\n")


def test_greedy_continuations_are_python(model, tokenizer) -> None:
    texts = continuations(model, tokenizer)
    valid = [is_python(p, c) for p, c in zip(PROMPTS, texts)]
    report = "\n\n".join(f"{ok}: {p + c!r}" for ok, p, c in zip(valid, PROMPTS, texts))
    assert sum(valid) > len(PROMPTS) / 2, report


def test_random_weights_fail_the_same_check(model, tokenizer) -> None:
    torch.manual_seed(0)
    random_model = LlamaForCausalLM(model.config).eval()
    texts = continuations(random_model, tokenizer)
    assert sum(is_python(p, c) for p, c in zip(PROMPTS, texts)) <= len(PROMPTS) / 2
