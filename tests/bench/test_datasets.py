"""Benchmark workloads: exact prompt lengths with the demo tokenizer, shared prefixes, ShareGPT files."""
from __future__ import annotations

import json

import pytest

from portcullis.bench.datasets import (
    DEMO_TOKENIZER_ID,
    load_tokenizer,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from portcullis.bench.errors import BenchError


@pytest.fixture(scope="module")
def tokenizer():
    tok, name = load_tokenizer(None, "demo")
    assert name == DEMO_TOKENIZER_ID
    return tok


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_have_exactly_the_tokens_asked_for(tokenizer):
    requests = random_requests(tokenizer, 40, 64, 16, range_ratio=0.5, prefix_len=5, seed=3)
    assert all(_count(tokenizer, r.prompt) == r.prompt_len for r in requests)
    assert all(5 + 32 <= r.prompt_len <= 5 + 96 and 8 <= r.expected_output_len <= 24 for r in requests)
    assert len({r.prompt for r in requests}) == 40
    fixed = random_requests(tokenizer, 10, 1, 1, range_ratio=0.0, prefix_len=0, seed=0)
    assert [r.prompt_len for r in fixed] == [1] * 10


def test_random_prompts_are_reproducible_from_the_seed(tokenizer):
    same = [random_requests(tokenizer, 5, 32, 8, 0.0, 0, seed=7) for _ in range(2)]
    assert same[0] == same[1] != random_requests(tokenizer, 5, 32, 8, 0.0, 0, seed=8)


def test_prefix_repetition_shares_each_prefix(tokenizer):
    requests = prefix_repetition_requests(tokenizer, 12, prefix_len=40, suffix_len=10, num_prefixes=3,
                                          output_len=5, seed=0)
    assert len(requests) == 12 and all(r.prompt_len == 50 and r.expected_output_len == 5 for r in requests)
    prefixes = {tokenizer.decode(tokenizer.encode(r.prompt, add_special_tokens=False)[:40]) for r in requests}
    assert len(prefixes) == 3
    with pytest.raises(BenchError, match="at least --prefix-repetition-num-prefixes"):
        prefix_repetition_requests(tokenizer, 2, 40, 10, 3, 5, seed=0)


def test_sharegpt_file(tokenizer, tmp_path):
    turn = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
    entries = [{"conversations": [{"from": "human", "value": turn}, {"from": "gpt", "value": turn}]},
               {"conversations": [{"from": "human", "value": "hi"}]},  # one turn: skipped
               {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": turn}]}]  # too short
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    requests = sharegpt_requests(tokenizer, str(path), 3, None, seed=0)
    assert len(requests) == 3 and requests[0].prompt == turn  # the one usable conversation, repeated
    assert requests[0].prompt_len == requests[0].expected_output_len == _count(tokenizer, turn)
    assert sharegpt_requests(tokenizer, str(path), 1, 7, seed=0)[0].expected_output_len == 7
    with pytest.raises(BenchError, match="needs --dataset-path"):
        sharegpt_requests(tokenizer, None, 1, None, seed=0)
    with pytest.raises(BenchError, match="cannot read"):
        sharegpt_requests(tokenizer, str(tmp_path / "missing.json"), 1, None, seed=0)


def test_a_tokenizer_that_cannot_load_says_what_to_pass(tmp_path):
    with pytest.raises(BenchError, match="pass --tokenizer DIR"):
        load_tokenizer(str(tmp_path), "my-model")
