"""Sliding-window layers free the KV blocks that fall out of their window (Gemma 3's random-weight
checkpoint: 3 sliding layers over 32 tokens and 1 full-attention layer, a KV-cache group each):
a long request holds far fewer blocks than with full attention everywhere, gives them back while
it decodes, and a prefix-cache hit takes of a sliding group only its window's blocks, all with
transformers' greedy tokens."""
from __future__ import annotations

import random

import pytest

from portcullis.engine import LLM, SamplingParams
from tests.support.parity import hf_greedy

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(checkpoint_factory):
    return checkpoint_factory("gemma3")


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), max_model_len=512, kv_cache_memory=16 << 20, dtype="float32", seed=0, **kwargs)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


def run(core, rid: str, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Generate for one request step by step: its tokens, and the pool's free blocks after each step."""
    core.add_request(rid, prompt, GREEDY)
    tokens, free = [], []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
        free.append(core.kv.pool.num_free)
        core.kv.check_integrity()
    return tokens, free


def test_a_long_request_holds_only_its_windows_and_frees_blocks_while_decoding(gemma3):
    llm = engine(gemma3)
    core = llm.engine
    assert core.model_runner.kv_sliding_windows == (32, 32, 32, None)  # 1 layer a group, sliding first
    prompt = prompt_of(300, seed=1)
    core.add_request("long", prompt, GREEDY)
    tokens, free, held = [], [], []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
        if core.has_unfinished_requests():
            held.append(core.kv.num_blocks_of(core.scheduler.requests["long"]))
        free.append(core.kv.pool.num_free)
        core.kv.check_integrity()
    assert tokens == hf_greedy(gemma3, (tuple(prompt),))[0]
    # Full attention everywhere: 4 groups of 21 blocks (331 tokens). Here the full layer's 21 and
    # each sliding layer's window (31 tokens before the newest) and newest block: 3 blocks.
    full_attention = 4 * -(-(300 + NEW_TOKENS - 1) // 16)
    assert held[-1] <= 21 + 3 * 3 < full_attention
    assert any(b > a for a, b in zip(free[1:], free[2:])), "no block came back while decoding"
    assert core.kv.pool.num_free == core.kv.pool.num_blocks


def test_a_prefix_hit_computes_every_block_a_sliding_layer_reads(gemma3):
    """Two requests share a 300-token prefix: the second's hit takes the full layer's blocks and
    only the windows' blocks of the sliding layers, and both give transformers' tokens."""
    shared = prompt_of(300, seed=2)
    first, second = shared + prompt_of(5, seed=3), shared + prompt_of(9, seed=4)
    want = hf_greedy(gemma3, (tuple(first), tuple(second)))
    core = engine(gemma3).engine
    assert run(core, "first", first)[0] == want[0]
    hits = core.kv.get_computed_blocks(core.scheduler.add("probe", second, GREEDY))
    core.scheduler.abort("probe")
    assert [len(group) for group in hits] == [18] * 4  # 300 tokens: 18 full blocks, then the rest computed
    for group in hits[:3]:  # a sliding group: the two blocks its window reads before position 288
        assert group[:16] == [None] * 16 and None not in group[16:]
    assert None not in hits[3]
    tokens, _ = run(core, "second", second)
    assert core.scheduler.stats.prefix_cache_hits == 18 * 16
    assert tokens == want[1]


def test_a_draft_model_keeps_every_block(gemma3):
    """A draft model computes its KV in the target's slots: with one, every layer keeps every
    block (one full-attention group), and the tokens stay exact."""
    llm = engine(gemma3, speculative_config={"method": "draft_model", "model": str(gemma3), "num_speculative_tokens": 3})
    assert llm.engine.model_runner.kv_sliding_windows == (None,)
    prompt = prompt_of(150, seed=5)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(gemma3, (tuple(prompt),))[0]
