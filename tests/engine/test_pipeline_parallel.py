"""Pipeline parallelism on CPUs (Gloo): the layers split into stages, one process each (times the
TP size), hidden states handed from stage to stage and the last stage's logits back to rank 0.
Greedy tokens equal transformers' exactly, on a dense and a mixture-of-experts family, with prefix
caching, chunked prefill, preemption and n-gram speculation; each stage holds only its layers."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.config import EngineConfig
from portcullis.engine.distributed import init_parallel, stage_layers
from portcullis.engine.model import loader
from portcullis.engine.model.layers import MissingLayer
from portcullis.engine.model.loader import load_model
from portcullis.engine.sampling_params import StructuredOutputsParams
from tests.support.parity import GREEDY, SETTINGS, assert_greedy_parity, hf_greedy, parity_prompts

# Every setting on the dense family; on the mixture of experts, the two that move the most (a
# prompt's chunks across steps; preemption with speculation), since its routing is per token.
TWO_STAGE_CASES = [*(("llama", s, "") for s in SETTINGS), ("llama", "preemption", "spec"),
                   ("qwen3_moe", "chunked-prefill", ""), ("qwen3_moe", "preemption", "spec")]


@pytest.mark.parametrize("kind, setting, spec", TWO_STAGE_CASES)
def test_two_stages_match_transformers(checkpoint_factory, kind, setting, spec):
    llm = assert_greedy_parity(checkpoint_factory(kind), setting, spec, pipeline_parallel_size=2)
    workers = llm.engine.workers.procs
    assert len(workers) == 1 and workers[0].is_alive()
    if spec:
        assert 0 < llm.engine.stats.spec_num_accepted_tokens <= llm.engine.stats.spec_num_draft_tokens
    llm.engine.shutdown()
    assert not workers[0].is_alive()


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_moe"])
def test_two_stages_of_two_tensor_parallel_ranks_match_transformers(checkpoint_factory, kind):
    """PP=2 × TP=2: four processes, each stage's ranks all-reducing in their own group; qwen2's
    tied head sits on the last stage, loaded from the embedding it does not hold. Prefix caching
    is on, prompts are prefilled in chunks and requests preempted, in one run."""
    llm = assert_greedy_parity(checkpoint_factory(kind), "preemption", pipeline_parallel_size=2,
                               tensor_parallel_size=2, max_num_batched_tokens=64)
    assert len(llm.engine.workers.procs) == 3
    llm.engine.shutdown()


def test_three_stages_of_mixed_window_layers_match_transformers(checkpoint_factory):
    """Gemma 3's 4 layers in 3 stages (1, 2, 1: the spare layer before the last stage), sliding and
    full attention mixed: one KV-cache group for all stages, each layer still masking its window."""
    path = checkpoint_factory("gemma3")
    prompts = parity_prompts()
    expected = hf_greedy(path, tuple(map(tuple, prompts)))
    with LLM(str(path), max_model_len=512, kv_cache_memory=32 << 20, pipeline_parallel_size=3, dtype="float32") as llm:
        assert llm.engine.info.num_kv_blocks > 0 and llm.engine.kv.num_groups == 1
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_structured_output_and_logprobs_come_back_from_the_last_stage(checkpoint_factory):
    """Rank 0 samples from logits the last stage sent: a grammar's mask, logprobs and prompt
    logprobs are what one process computes."""
    path = checkpoint_factory("llama")
    prompt = parity_prompts()[3]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    results = []
    for pp in (1, 2):
        with LLM(str(path), max_model_len=512, kv_cache_memory=32 << 20, pipeline_parallel_size=pp,
                 dtype="float32") as llm:
            results.append(llm.generate([prompt], params, use_tqdm=False)[0])
    one, two = results
    assert two.outputs[0].text in ("yes", "no", "maybe")
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    for got, want in ((two.outputs[0].logprobs, one.outputs[0].logprobs), (two.prompt_logprobs[1:], one.prompt_logprobs[1:])):
        assert [row.token_id for row in got] == [row.token_id for row in want]
        assert _logprob_values(got) == pytest.approx(_logprob_values(want), abs=1e-5)


def _logprob_values(rows) -> list[float]:
    """Each position's chosen token's logprob, then its top candidates'."""
    return [value for row in rows for value in (row.logprob, *(lp for _, lp in row.top))]


@pytest.mark.parametrize("kind, stages", [("llama", 2), ("qwen2", 2), ("gemma3", 3), ("qwen3_moe", 2)])
def test_each_stage_holds_only_its_layers(checkpoint_factory, monkeypatch, kind, stages):
    """Built as rank k of `stages` would build it: stage k has the weights of its layers only (the
    embedding on the first, norm and head on the last; a tied head on the last stage is a copy of
    the embedding), and its KV cache is sized by those layers: together the stages hold the whole
    model once, plus the tied head."""
    path = checkpoint_factory(kind)
    monkeypatch.setattr("portcullis.engine.model.loader.pack_linear_weights", lambda model: 0)  # weights stay parameters
    read: list[str] = []  # the checkpoint tensors each load reads
    real_load = loader.load_weights
    monkeypatch.setattr(loader, "load_weights",
                        lambda model, weights: real_load(model, ((read.append(n) or (n, t)) for n, t in weights)))
    config = EngineConfig(str(path), max_model_len=512, dtype="float32")
    full = _parameter_bytes(_load(config))
    layers = config.hf_config.num_hidden_layers
    total, kv_slots = 0, 0
    try:
        for stage in range(stages):
            init_parallel(stage, 1, stages)
            read.clear()
            model = _load(config)
            own = stage_layers(layers, stage, stages)
            assert {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")} == set(own)  # never read
            held = {i for i, layer in enumerate(model.model.layers) if not isinstance(layer, MissingLayer)}
            assert held == set(own)
            names = {name for name, _ in model.named_parameters()}
            assert any(n.startswith("model.embed_tokens.") for n in names) == (stage == 0)
            assert any(n.startswith("model.norm.") for n in names) == (stage == stages - 1)
            assert ("lm_head.weight" in names) == (stage == stages - 1 and (stage > 0 or not model.tie_word_embeddings))
            assert all(int(n.split(".")[2]) in own for n in names if n.startswith("model.layers."))
            assert len(model.attention_layers()) == len(own)
            total += _parameter_bytes(model)
            kv_slots += len(model.attention_layers())
    finally:
        init_parallel(0, 1)
    tied_copy = config.hf_config.vocab_size * config.hf_config.hidden_size * 4 if model.tie_word_embeddings else 0
    assert total == full + tied_copy
    assert kv_slots == layers


def test_more_stages_than_layers_or_embeddings_are_refused(checkpoint_factory):
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        EngineConfig(str(checkpoint_factory("llama")), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(str(checkpoint_factory("llama")), pipeline_parallel_size=0)


def _load(config: EngineConfig):
    return load_model(config.model_path, config.hf_config, config.torch_dtype, torch.device("cpu"),
                      config.max_model_len)


def _parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_stages_work_on_two_steps_at_once_and_an_abort_in_flight_is_skipped(checkpoint_factory):
    """The batch queue holds a step per stage: rank 0 submits the next while the last stage
    computes the one before. A request aborted while its step is in flight gets nothing more, its
    blocks go back, and the others still give transformers' tokens."""
    path = checkpoint_factory("llama")
    prompts = parity_prompts()
    expected = hf_greedy(path, tuple(map(tuple, prompts)))
    with LLM(str(path), max_model_len=512, kv_cache_memory=32 << 20, pipeline_parallel_size=2, dtype="float32",
             max_num_batched_tokens=256) as llm:
        core = llm.engine
        for i, prompt in enumerate(prompts):
            core.add_request(f"r{i}", prompt, GREEDY)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        depths, aborted = [], None
        while core.has_unfinished_requests():
            outs = core.step()
            for out in outs:
                tokens[out.request_id] += out.new_token_ids
            if outs:  # a step was collected: how many stayed in flight meanwhile
                depths.append(len(core.batch_queue))
            in_flight = {rid for out, _ in core.batch_queue for rid in out.request_ids}
            if aborted is None and len(tokens["r0"]) == 3 and "r0" in in_flight:
                aborted = core.abort(["r0"])
        core.kv.check_integrity()
        assert core.kv.pool.num_free == core.kv.pool.num_blocks
    assert max(depths) == 1 and depths.count(1) > len(depths) // 2  # mostly two steps at once
    assert aborted and aborted[0].finish_reason == "abort" and len(tokens["r0"]) == 3
    assert [tokens[f"r{i}"] for i in range(1, len(prompts))] == expected[1:]


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)])
def test_idle_ranks_outlive_the_timeout_and_a_hung_rank_ends_the_engine(checkpoint_factory, monkeypatch, parallel):
    """Each wait between ranks is bounded (PORTCULLIS_DISTRIBUTED_TIMEOUT_S, here 2 s): idle
    ranks stay alive past it on rank 0's heartbeats, while a rank that stops answering makes the
    next step fail within it instead of hanging."""
    monkeypatch.setenv("PORTCULLIS_DISTRIBUTED_TIMEOUT_S", "2")
    path = checkpoint_factory("llama")
    prompts = parity_prompts()[:2]
    expected = hf_greedy(path, tuple(map(tuple, parity_prompts())))[:2]
    with LLM(str(path), max_model_len=512, kv_cache_memory=32 << 20, dtype="float32", **parallel) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        time.sleep(5)  # idle for more than twice the timeout
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        (worker,) = llm.engine.workers.procs
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RuntimeError):
                llm.generate(prompts, GREEDY, use_tqdm=False)
            assert time.monotonic() - started < 30
        finally:
            os.kill(worker.pid, signal.SIGKILL)
