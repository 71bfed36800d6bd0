"""Phi-3 (fused `qkv_proj` and `gate_up_proj` checkpoints, LongRoPE) gives transformers' greedy
tokens in float32 in every scheduler setting and at TP=2, where each fused tensor is split into its
parts before sharding. LongRoPE runs up to its original context, where transformers uses the short
factors, and is refused beyond it."""
from __future__ import annotations

import pytest

from portcullis.engine import LLM
from tests.conftest import build_checkpoint
from tests.support.parity import GREEDY, SETTINGS, assert_greedy_parity, hf_greedy, parity_prompts


@pytest.fixture(scope="module")
def phi3_model(checkpoint_factory):
    return checkpoint_factory("phi3")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(phi3_model, setting):
    # Every layer slides over 64 tokens, so a request holds at most 9 blocks: 24 make them preempt.
    assert_greedy_parity(phi3_model, setting, **({"num_blocks": 24} if setting == "preemption" else {}))


def test_tensor_parallel_two_ranks_matches_transformers(phi3_model):
    prompts = parity_prompts()[:5]
    expected = hf_greedy(phi3_model, tuple(map(tuple, parity_prompts())))[:5]
    with LLM(str(phi3_model), max_model_len=512, kv_cache_memory=32 << 20, tensor_parallel_size=2,
             dtype="float32") as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_the_longrope_short_factors_change_the_tokens(phi3_model, tmp_path):
    """Guards the parity test: the same weights with plain RoPE generate other tokens."""
    plain = build_checkpoint("phi3", tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    prompts = tuple(map(tuple, parity_prompts()))
    assert hf_greedy(plain, prompts) != hf_greedy(phi3_model, prompts)


def test_longrope_beyond_its_original_context_is_refused(phi3_model):
    """transformers switches to the long factors mid-sequence, past 1024 positions here: refused,
    saying what to do (the model's own limit, 2048, is the default max_model_len)."""
    with pytest.raises(ValueError, match=r"LongRoPE.*--max-model-len to at most 1024"):
        LLM(str(phi3_model), kv_cache_memory=16 << 20, dtype="float32")
    with LLM(str(phi3_model), max_model_len=1024, kv_cache_memory=16 << 20, dtype="float32"):
        pass


def test_partial_rotary_embeddings_are_refused(tmp_path):
    """Phi-4-mini's checkpoints use Phi-3's architecture but rotate only part of each head."""
    path = build_checkpoint("phi3", tmp_path, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        LLM(str(path), max_model_len=512, kv_cache_memory=16 << 20, dtype="float32")
