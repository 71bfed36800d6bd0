"""Benchmark workloads, as `vllm bench serve` builds them: random prompts of an exact token
count, prompts sharing a few long prefixes, or conversations from a ShareGPT-format file."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from portcullis.bench.errors import BenchError

DEMO_MODEL = "demo"
DEMO_TOKENIZER_ID = "engine/assets/demo-model"
# Whole-word pieces ("Ġname" byte-level, "▁name" SentencePiece) keep their boundaries when a
# sequence of them is decoded and encoded again, so a prompt has exactly the tokens it was
# built from; other pieces merge with their neighbours and need the retry loop below.
WORD_PIECE = re.compile(r"[Ġ▁][A-Za-z]+")
MIN_WORD_PIECES = 100
FIT_TRIES = 10


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def load_tokenizer(name: str | None, model: str) -> tuple[Any, str]:
    """The tokenizer and the id to record: `--tokenizer`, else the demo model's for the
    model "demo", else the model name as a local folder or a Hub id (as vLLM does)."""
    if name is None and model == DEMO_MODEL:
        from portcullis.engine.assets import DEMO_MODEL_DIR

        return _from_pretrained(str(DEMO_MODEL_DIR)), DEMO_TOKENIZER_ID
    name = name or model
    return _from_pretrained(name), name


def _from_pretrained(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # transformers raises OSError, ValueError or hub errors
        raise BenchError(f"cannot load a tokenizer from {name!r} ({type(exc).__name__}); pass --tokenizer "
                         "DIR, a local Hugging Face model or tokenizer folder") from None


class PromptBuilder:
    """Turns token ids into text that the tokenizer reads back as exactly that many tokens."""

    def __init__(self, tokenizer: Any, rng: np.random.Generator) -> None:
        self.tokenizer, self.rng = tokenizer, rng
        special = set(tokenizer.all_special_ids)
        allowed = [i for i in range(tokenizer.vocab_size) if i not in special]
        pieces = tokenizer.convert_ids_to_tokens(allowed)
        words = [i for i, piece in zip(allowed, pieces) if isinstance(piece, str) and WORD_PIECE.fullmatch(piece)]
        self.pool = np.array(words if len(words) >= MIN_WORD_PIECES else allowed)

    def sequence(self, start: int, length: int) -> list[int]:
        """`length` consecutive pool tokens from `start`, as vLLM's (offset + i + arange) walk."""
        return self.pool[(start + np.arange(length)) % len(self.pool)].tolist()

    def sample(self, length: int) -> list[int]:
        return self.pool[self.rng.integers(0, len(self.pool), size=length)].tolist()

    def fit(self, ids: list[int], length: int) -> tuple[str, list[int]]:
        """Decode, encode again, pad or cut until the text is `length` tokens (vLLM's
        gen_prompt_decode_to_target_len); after FIT_TRIES the text keeps its true count."""
        text = self.tokenizer.decode(ids)
        for _ in range(FIT_TRIES):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == length:
                break
            ids = ids[:length] if len(ids) > length else ids + self.sample(length - len(ids))
            text = self.tokenizer.decode(ids)
        return text, self.tokenizer.encode(text, add_special_tokens=False)


def random_requests(tokenizer: Any, num: int, input_len: int, output_len: int, range_ratio: float,
                    prefix_len: int, seed: int) -> list[SampleRequest]:
    if not 0 <= range_ratio < 1:
        raise BenchError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    builder = PromptBuilder(tokenizer, rng)
    real_input = max(0, input_len - tokenizer.num_special_tokens_to_add())  # the BOS the server adds
    low, high = _length_range(real_input, range_ratio)
    if prefix_len + low < 1:
        raise BenchError("--random-input-len is too small: every prompt needs at least one token")
    out_low, out_high = _length_range(output_len, range_ratio, least=1)
    input_lens = rng.integers(low, high + 1, size=num)
    output_lens = rng.integers(out_low, out_high + 1, size=num)
    offsets = rng.integers(0, len(builder.pool), size=num)
    prefix = builder.sample(prefix_len)
    requests = []
    for i in range(num):
        text, ids = builder.fit(prefix + builder.sequence(int(offsets[i]) + i, int(input_lens[i])),
                                prefix_len + int(input_lens[i]))
        requests.append(SampleRequest(text, len(ids), int(output_lens[i])))
    return requests


def _length_range(length: int, ratio: float, least: int = 0) -> tuple[int, int]:
    """[length * (1 - ratio), length * (1 + ratio)], floor and ceiling, as vLLM draws lengths."""
    return max(least, math.floor(length * (1 - ratio))), max(least, math.ceil(length * (1 + ratio)))


def prefix_repetition_requests(tokenizer: Any, num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int) -> list[SampleRequest]:
    """`num_prefixes` random prefixes, each shared by num // num_prefixes prompts with their
    own random suffix, shuffled: the prefix cache's workload."""
    per_prefix = num // max(num_prefixes, 1)
    if per_prefix == 0:
        raise BenchError(f"--num-prompts ({num}) must be at least --prefix-repetition-num-prefixes ({num_prefixes})")
    rng = np.random.default_rng(seed)
    builder = PromptBuilder(tokenizer, rng)
    requests = []
    for _ in range(num_prefixes):
        _, prefix = builder.fit(builder.sample(prefix_len), prefix_len)
        for _ in range(per_prefix):
            _, suffix = builder.fit(builder.sample(suffix_len), suffix_len)
            text = tokenizer.decode(prefix + suffix)
            requests.append(SampleRequest(text, len(prefix) + len(suffix), output_len))
    return [requests[i] for i in rng.permutation(len(requests))]


def sharegpt_requests(tokenizer: Any, path: str | None, num: int, output_len: int | None,
                      seed: int) -> list[SampleRequest]:
    """The first human turn as the prompt, the reply's length (or --sharegpt-output-len) as the
    output, skipping what vLLM skips (under 4 tokens, prompt over 1024, total over 2048)."""
    if not path:
        raise BenchError("--dataset-name sharegpt needs --dataset-path, a ShareGPT-format JSON file")
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read the ShareGPT file {path}: {exc}") from None
    conversations = [e["conversations"] for e in entries
                     if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    rng = np.random.default_rng(seed)
    requests = []
    for i in rng.permutation(len(conversations)):
        if len(requests) == num:
            break
        prompt, reply = conversations[i][0]["value"], conversations[i][1]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len >= 4 and (output_len or out >= 4) and prompt_len <= 1024 and prompt_len + out <= 2048:
            requests.append(SampleRequest(prompt, prompt_len, out))
    if not requests:
        raise BenchError(f"{path} has no usable conversation (two turns, 4 to 1024 prompt tokens)")
    # Too few: repeat them, as vLLM oversamples, so --num-prompts is what runs.
    return [requests[i % len(requests)] for i in range(num)]
