"""Greedy decoding matches Hugging Face transformers token for token, whatever the engine does
underneath: prefix caching on or off, chunked prefill, preemption under memory pressure, each
with and without speculative decoding: n-gram proposals, or a draft model (here the target's own
weights, so every proposal must be accepted: that checks the draft's KV cache, which mirrors the
target's slot by slot, through prefix hits, chunked prefills and preemptions)."""
from __future__ import annotations

import pytest

from portcullis.engine import LLM, SamplingParams
from tests.support.parity import NEW_TOKENS, hf_greedy, parity_prompts

KINDS = ["llama", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

SETTINGS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=64),
    # The eight prompts fit in 41 blocks and all start at once; finishing them needs 57: so requests
    # must be preempted and recomputed.
    "preemption": dict(num_blocks=45),
}
# Random-weight models repeat themselves, so n-gram proposals are found, and some accepted.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _speculative_config(path, spec: str) -> dict | None:
    if spec == "draft":
        return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    return NGRAM if spec == "spec" else None


def _engine(path, setting: str, spec: str = "") -> LLM:
    kwargs = dict(SETTINGS[setting], speculative_config=_speculative_config(path, spec))
    num_blocks = kwargs.pop("num_blocks", None)
    # Exact parity with HF's float32: pinned, since `auto` may pick bfloat16 on a CPU with fast bf16.
    llm_kwargs = dict(max_model_len=512, seed=0, dtype="float32", **kwargs)
    if num_blocks is not None:  # a draft model's layers take their share of each block's bytes
        probe = LLM(str(path), max_model_len=512, kv_cache_memory=1 << 20, dtype="float32",
                    speculative_config=kwargs["speculative_config"])
        per_block = probe.engine.model_runner.kv_bytes_per_block()
        llm_kwargs["kv_cache_memory"] = num_blocks * per_block
    else:
        llm_kwargs["kv_cache_memory"] = 64 << 20
    return LLM(str(path), **llm_kwargs)


@pytest.mark.parametrize("spec", ["", "spec", "draft"], ids=["", "spec", "draft"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(checkpoint_factory, kind, setting, spec):
    path = checkpoint_factory(kind)
    prompts = parity_prompts()
    expected = hf_greedy(path, tuple(map(tuple, prompts)))
    llm = _engine(path, setting, spec)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == want, f"prompt {i} (length {len(prompts[i])}) diverged"
        assert out.outputs[0].finish_reason == "length"
    if setting == "preemption":
        assert llm.engine.stats.num_preemptions > 0
    if spec:
        stats = llm.engine.stats
        assert stats.spec_num_draft_tokens > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
        assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    if spec == "draft":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    llm.engine.kv.pool.check_integrity()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


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
