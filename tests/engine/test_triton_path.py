"""The engine through its Triton kernels (as on a GPU), here through Triton's interpreter: the
kernels are tested alone in tests/kernels; this checks the engine's own metadata (block tables,
cumulative query lengths, slot mappings, strided Q/K/V views) drives them to the exact tokens
transformers gives, with prefill chunks and decodes mixed in one step."""
from __future__ import annotations

import portcullis.kernels.triton_attention as triton_attention
from portcullis.engine import LLM, SamplingParams
from tests.support.parity import hf_greedy, parity_prompts

NEW_TOKENS = 6


def test_greedy_through_triton_kernels_matches_transformers(checkpoint_factory, monkeypatch):
    monkeypatch.setenv("PORTCULLIS_ATTENTION", "triton")
    calls = {"attention": 0, "cache": 0}
    for name, key in (("paged_attention_triton", "attention"), ("write_kv_cache_triton", "cache")):
        kernel = getattr(triton_attention, name)
        monkeypatch.setattr(triton_attention, name, _counted(kernel, calls, key))
    path = checkpoint_factory("qwen3")
    prompts = [p for p in parity_prompts() if len(p) in (1, 17, 33)]
    expected = hf_greedy(path, tuple(map(tuple, prompts)), NEW_TOKENS)
    # A 24-token budget splits the 33-token prompt into chunks that share steps with decodes.
    llm = LLM(str(path), max_model_len=256, kv_cache_memory=8 << 20, max_num_batched_tokens=24, seed=0,
              dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls["attention"] > 0 and calls["cache"] > 0, "the Triton kernels were not used"


def _counted(kernel, calls: dict, key: str):
    def wrapper(*args, **kwargs):
        calls[key] += 1
        return kernel(*args, **kwargs)

    return wrapper
