"""Greedy decoding matches Hugging Face transformers token for token, whatever the engine does
underneath: prefix caching on or off, chunked prefill, preemption under memory pressure, each
with and without speculative decoding: n-gram proposals, or a draft model (here the target's own
weights, so every proposal must be accepted: that checks the draft's KV cache, which mirrors the
target's slot by slot, through prefix hits, chunked prefills and preemptions)."""
from __future__ import annotations

import pytest

from portcullis.engine import LLM, SamplingParams
from tests.support.parity import (
    GREEDY,
    NEW_TOKENS,
    SETTINGS,
    assert_greedy_parity,
    hf_greedy,
    parity_prompts,
)
from tests.support.parity import (
    engine_for as _engine,
)

KINDS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("spec", ["", "spec", "draft"], ids=["", "spec", "draft"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(checkpoint_factory, kind, setting, spec):
    llm = assert_greedy_parity(checkpoint_factory(kind), setting, spec)
    if spec:
        stats = llm.engine.stats
        assert stats.spec_num_draft_tokens > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
        assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    if spec == "draft":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tensor_parallel_two_ranks_matches_transformers(checkpoint_factory, kind):
    """TP=2 on CPU (Gloo): sharded layers, rank 0 broadcasting each step, same greedy tokens."""
    path = checkpoint_factory(kind)
    prompts = parity_prompts()[:5]
    expected = hf_greedy(path, tuple(map(tuple, parity_prompts())))[:5]
    with LLM(str(path), max_model_len=512, kv_cache_memory=32 << 20, tensor_parallel_size=2, dtype="float32") as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        workers = llm.engine.workers.procs
        assert all(p.is_alive() for p in workers)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert not any(p.is_alive() for p in workers)  # shut down with the engine



def test_penalties_and_logprobs_survive_preemption(checkpoint_factory):
    """A preempted request is rebuilt by the runner from the scheduler's plain data: penalties see
    the same history, and prompt logprobs are neither lost nor repeated. (Greedy: a recomputed
    prefill rounds differently from the decodes it replaces, which can move a random draw.)"""
    path = checkpoint_factory("llama")
    prompts = parity_prompts()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.2, logprobs=2, prompt_logprobs=2)
    calm = _engine(path, "default").generate(prompts, params, use_tqdm=False)
    pressed_llm = _engine(path, "preemption")
    pressed = pressed_llm.generate(prompts, params, use_tqdm=False)
    assert pressed_llm.engine.stats.num_preemptions > 0
    for a, b in zip(calm, pressed):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(b.prompt_token_ids)
        assert [lp.token_id for lp in b.prompt_logprobs[1:]] == b.prompt_token_ids[1:]
        pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) + list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in pairs)
