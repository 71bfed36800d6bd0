"""EngineCore and LLM behaviour a user relies on: prefix caching saves work, seeded sampling is
reproducible whatever shares the batch, bad input is refused clearly and harms no one else."""
from __future__ import annotations

import random

import pytest

from portcullis.engine import LLM, RequestError, SamplingParams
from portcullis.engine.sampling_params import MAX_LOGPROBS, sample_seed
from tests.support.parity import hf_greedy


@pytest.fixture(scope="module")
def llm(checkpoint_factory) -> LLM:
    return LLM(str(checkpoint_factory("qwen2")), max_model_len=1200, kv_cache_memory=64 << 20, seed=0, dtype="float32")


def test_shared_prefix_computes_only_new_tokens(llm, checkpoint_factory):
    rng = random.Random(7)
    prefix = [rng.randrange(3, 4096) for _ in range(1000)]
    first = prefix + [rng.randrange(3, 4096) for _ in range(20)]
    second = prefix + [rng.randrange(3, 4096) for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([first], params, use_tqdm=False)
    before = llm.engine.stats.num_computed_tokens
    out = llm.generate([second], params, use_tqdm=False)[0]
    computed = llm.engine.stats.num_computed_tokens - before
    cached = (1000 // 16) * 16  # every full block of the shared prefix
    assert out.num_cached_tokens == cached
    # New prompt tokens once, then one token per decode step after the first sampled token.
    assert computed == len(second) - cached + (8 - 1)
    assert out.outputs[0].token_ids == hf_greedy(checkpoint_factory("qwen2"), (tuple(second),), 8)[0]


def test_seeded_sampling_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=12, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [[11] * 30, [12, 13] * 20, [14] * 3]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(others[:1] + [prompt] + others[1:], [noise, seeded, noise, noise], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=43, max_tokens=12, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    prompt = [21, 22, 23, 24]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate([prompt], SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 1200, SamplingParams(max_tokens=1), "context length"),
        ([1] * 1190, SamplingParams(max_tokens=20), "exceeds the context length"),
        ([1, 99999], SamplingParams(), "token ids must be integers"),
        ([1, -3], SamplingParams(), "token ids must be integers"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_sampling_params_are_refused():
    for kwargs, message in [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


def test_refusals_name_the_field_at_fault(llm):
    for kwargs, param in [
        (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"), (dict(min_p=2), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logit_bias={1: 200}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(n=0), "n"),
    ]:
        with pytest.raises(RequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == param, kwargs
    for prompt, params, param in [
        ([], SamplingParams(), "prompt"),
        ([1] * 1200, SamplingParams(max_tokens=1), "prompt"),
        ([1] * 1190, SamplingParams(max_tokens=20), "max_tokens"),
        ([1, 99999], SamplingParams(), "prompt"),
    ]:
        with pytest.raises(RequestError) as info:
            llm.generate([prompt], params, use_tqdm=False)
        assert info.value.param == param, info.value
    assert not llm.engine.has_unfinished_requests()


def test_one_seed_rule_for_every_front_end():
    assert [sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert sample_seed(2**64 - 1, 1) == 0  # wraps at the generator's width
    assert sample_seed(None, 3) is None
    params = SamplingParams(n=3, seed=2**64 - 2, temperature=1.0)
    assert [params.for_sample(i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]


def test_kv_pool_too_small_for_one_request(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    probe = LLM(path, max_model_len=512, kv_cache_memory=1 << 20)
    small = LLM(path, max_model_len=512, kv_cache_memory=4 * probe.engine.model_runner.kv_bytes_per_block())
    with pytest.raises(ValueError, match="KV-cache blocks"):
        small.generate([[1] * 100], SamplingParams(max_tokens=10), use_tqdm=False)
    out = small.generate([[1] * 20], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10


def test_abort_frees_blocks_at_once(llm):
    core = llm.engine
    core.add_request("to-abort", list(range(10, 200)), SamplingParams(max_tokens=50))
    core.step()
    assert core.kv.pool.num_free < core.kv.pool.num_blocks
    core.abort(["to-abort"])
    assert not core.has_unfinished_requests()
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
    core.kv.pool.check_integrity()


def test_outputs_are_in_input_order_with_text(checkpoint_factory):
    llm = LLM(str(checkpoint_factory("llama")), max_model_len=256, kv_cache_memory=16 << 20)
    prompts = ["def f(x):", "import os", "class A:"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    for o in outs:
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.metrics.first_token_time is not None


def test_unsupported_architecture_is_named(tmp_path, checkpoint_factory):
    import json
    import shutil

    src = checkpoint_factory("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: LlamaForCausalLM"):
        LLM(str(tmp_path))


def _with_generation_config(source, tmp_path, fields: dict):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def test_generate_without_params_samples_with_the_model_s_generation_config(checkpoint_factory, tmp_path):
    folder = _with_generation_config(checkpoint_factory("qwen2"), tmp_path,
                                     {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 5, "do_sample": False})
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=16 << 20, dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 1.3, 5)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    implicit = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5)
    assert implicit.token_ids == llm.generate([prompt], explicit, use_tqdm=False)[0].outputs[0].token_ids
    assert len(implicit.token_ids) <= 5
    # "vllm" ignores the file: SamplingParams()' own defaults
    plain = LLM(str(folder), max_model_len=256, kv_cache_memory=16 << 20, dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_generation_config_values_equal_to_transformers_defaults_are_ignored_as_vllm_does(tmp_path):
    # vLLM reads the file through GenerationConfig.to_diff_dict(): "top_k": 50 is transformers'
    # default there, so it leaves top-k off; the other values apply.
    import json

    from portcullis.engine.sampling_params import generation_config_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"top_k": 50, "top_p": 1.0, "temperature": 0.7, "repetition_penalty": 1.05, "max_new_tokens": 64}))
    assert generation_config_defaults("auto", tmp_path) == {"temperature": 0.7, "repetition_penalty": 1.05,
                                                            "max_new_tokens": 64}


def test_the_model_s_max_new_tokens_is_cut_to_the_room_a_prompt_leaves(checkpoint_factory, tmp_path):
    # A default, not a demand (as the server and vLLM treat it): a prompt is not refused for it.
    folder = _with_generation_config(checkpoint_factory("qwen2"), tmp_path, {"max_new_tokens": 512})
    llm = LLM(str(folder), max_model_len=64, kv_cache_memory=16 << 20, dtype="float32")
    short, long = [5, 6, 7], list(range(3, 63))
    outs = llm.generate([short, long], use_tqdm=False)
    assert all(len(p) + len(o.outputs[0].token_ids) <= 64 for p, o in zip((short, long), outs))
    assert len(outs[1].outputs[0].token_ids) <= 4 and llm.get_default_sampling_params().max_tokens == 512
    with pytest.raises(ValueError, match="max_tokens"):  # a limit the caller sets is still checked
        llm.generate([long], SamplingParams(max_tokens=512), use_tqdm=False)


def test_a_generation_config_out_of_range_fails_the_llm_with_the_field_named(checkpoint_factory, tmp_path):
    folder = _with_generation_config(checkpoint_factory("qwen2"), tmp_path, {"repetition_penalty": -1})
    with pytest.raises(ValueError, match="repetition_penalty"):
        LLM(str(folder), max_model_len=256, kv_cache_memory=16 << 20, dtype="float32")
