"""Draft-model speculative decoding (`"method": "draft_model"`): a small model of the target's
vocabulary proposes, the target verifies as for n-gram proposals. The output is exactly what the
target gives without speculation; the draft's KV cache mirrors the target's block by block (a
draft with the target's own weights is always right); mismatched drafts are refused at start."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.config import EngineConfig, SpeculativeConfig
from tests.conftest import build_checkpoint

PROMPTS = [[5, 6, 7, 8] * 6, list(range(100, 140)), [11, 12] * 20, [300, 301, 302, 5, 6, 7, 300, 301]]
ENGINE = dict(max_model_len=512, kv_cache_memory=32 << 20, seed=0)


@pytest.fixture(scope="module")
def target(checkpoint_factory):
    return checkpoint_factory("qwen2")


@pytest.fixture(scope="module")
def small_draft(target, tmp_path_factory):
    """Another, smaller model of the same vocabulary and tokenizer: it guesses, often wrongly."""
    return build_checkpoint("qwen2", tmp_path_factory.mktemp("draft"), seed=1, num_hidden_layers=1, hidden_size=32,
                            intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def draft_config(model, k: int = 4) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target), **ENGINE)


@pytest.fixture(scope="module")
def drafted(target, small_draft):
    return LLM(str(target), **ENGINE, speculative_config=draft_config(small_draft))


def test_a_model_without_method_is_a_draft_model_as_in_vllm():
    assert SpeculativeConfig.parse('{"model": "d", "num_speculative_tokens": 3}').method == "draft_model"
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 3}').method == "ngram"
    for bad, words in [('{"method": "draft_model"}', "needs \"model\""), ('{"method": "ngram", "model": "d"}', "takes no")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


@pytest.mark.parametrize("params", [
    dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3),
    dict(temperature=0.9, top_p=0.9, seed=11, logprobs=2, presence_penalty=0.7, min_tokens=10),
])
def test_outputs_are_identical_with_and_without_a_draft(plain, drafted, params):
    """Greedy and seeded sampling: drafting is greedy, so verification stays exact at any temperature."""
    sp = SamplingParams(max_tokens=32, ignore_eos=True, **params)
    stats = drafted.engine.stats
    before = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    want = plain.generate(PROMPTS, sp, use_tqdm=False)
    got = drafted.generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(b.outputs[0].token_ids) == 32
        if sp.logprobs is not None:
            assert [lp.token_id for lp in b.outputs[0].logprobs] == b.outputs[0].token_ids
            assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
    assert stats.spec_num_draft_tokens > before[0]  # the draft proposed, and the target verified
    if sp.temperature == 0:  # some were right (random models repeat themselves, and so does a random draft)
        assert stats.spec_num_accepted_tokens > before[1]
    assert_counters_add_up(stats)
    drafted.engine.kv.pool.check_integrity()


def assert_counters_add_up(stats) -> None:
    per_position = stats.spec_accepted_per_position
    assert sum(per_position) == stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert per_position[0] <= stats.spec_num_drafts
    # Position j is accepted only after positions 0..j-1 were.
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))


def test_the_targets_own_weights_as_draft_are_always_accepted(target, plain):
    """The draft computes its KV in the target's slots (catch-up forwards, lookahead slots): a draft
    identical to the target proposes exactly the target's greedy tokens only if none is missing or
    stale, through prefix-cache hits, chunked prefills and fully accepted runs."""
    llm = LLM(str(target), **{**ENGINE, "max_num_batched_tokens": 48}, speculative_config=draft_config(target, 5))
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    for _ in range(2):  # the second round hits the prefix cache
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
    stats = llm.engine.stats
    assert stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 100 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert_counters_add_up(stats)


def test_preemption_recomputes_the_draft_kv_too(target, small_draft, plain):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    for draft in (target, small_draft):
        probe = LLM(str(target), **ENGINE, speculative_config=draft_config(draft))
        per_block = probe.engine.model_runner.kv_bytes_per_block()  # the target's and the draft's layers
        # The four requests end holding 17 blocks: with 10, some are preempted and recomputed.
        llm = LLM(str(target), **{**ENGINE, "kv_cache_memory": 10 * per_block}, speculative_config=draft_config(draft))
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
        stats = llm.engine.stats
        assert stats.num_preemptions > 0
        if draft == target:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
        llm.engine.kv.pool.check_integrity()
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_abort_mid_run_leaves_the_cache_whole(drafted):
    core = drafted.engine
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"abort-{i}", prompt, sp)
    for _ in range(4):
        core.step()
    core.abort(["abort-0", "abort-2"])
    while core.has_unfinished_requests():
        core.step()
    core.kv.pool.check_integrity()
    assert core.kv.pool.num_free == core.kv.pool.num_blocks and not core.kv.req_blocks


def test_random_streams_of_add_step_abort_keep_the_draft_exact(target, plain):
    """Requests added, stepped and aborted in a random (seeded) order, with shared prefixes and
    chunked prefills: with the target's own weights as draft every proposal is accepted, the
    finished requests give the plain engine's tokens, and the cache is whole throughout."""
    rnd = random.Random(7)
    llm = LLM(str(target), **{**ENGINE, "max_num_batched_tokens": 40}, speculative_config=draft_config(target, 3))
    core, runner = llm.engine, llm.engine.model_runner
    prefixes = [[rnd.randrange(4096) for _ in range(20)] for _ in range(2)]
    requests, got, finished, aborted = {}, {}, set(), set()
    for op in range(60):
        live = [rid for rid in requests if rid not in finished and rid not in aborted]
        if op % 10 == 9 and live:
            aborted.add(rid := rnd.choice(live))
            core.abort([rid])
        elif rnd.random() < 0.3:
            prompt = rnd.choice(prefixes)[: rnd.randint(4, 20)] + [rnd.randrange(4096) for _ in range(rnd.randint(1, 30))]
            rid = f"r{len(requests)}"
            requests[rid] = (prompt, SamplingParams(temperature=0, max_tokens=rnd.randint(4, 24), ignore_eos=True))
            core.add_request(rid, *requests[rid])
        else:
            collect(core.step(), got, finished)
        core.kv.pool.check_integrity()
        assert all(r.draft_computed <= r.num_computed_tokens for r in runner.input_batch.requests.values())
        for req in core.scheduler.running:  # the runner's block table holds the scheduler's blocks, trims included
            row = runner.input_batch.requests[req.request_id].row
            assert runner.input_batch.block_tables[0][row, : runner.input_batch.row_len[row]].tolist() == \
                [b.block_id for b in core.kv.req_blocks[req.request_id][0]]
    while core.has_unfinished_requests():
        collect(core.step(), got, finished)
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
    done = [rid for rid in requests if rid not in aborted]
    want = plain.generate([requests[rid][0] for rid in done], [requests[rid][1] for rid in done], use_tqdm=False)
    assert [got[rid] for rid in done] == [o.outputs[0].token_ids for o in want]
    assert core.stats.spec_num_accepted_tokens == core.stats.spec_num_draft_tokens > 0
    assert aborted and len(done) > 5 and core.stats.prefix_cache_hits > 0  # the stream did what it says


def collect(outputs, got: dict[str, list[int]], finished: set[str]) -> None:
    for out in outputs:
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finished.add(out.request_id)


def test_a_draft_with_another_vocabulary_is_refused_at_start(target, tmp_path):
    other = build_checkpoint("qwen2", tmp_path / "v", vocab_size=4000, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary has 4000 tokens and the target's 4096"):
        EngineConfig(model=str(target), speculative_config=draft_config(other))


def test_a_draft_with_another_tokenizer_is_refused_at_start(target, tmp_path):
    other = tmp_path / "tok"
    shutil.copytree(target, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[300:302]  # two ordinary tokens swap ids: same size, other meaning
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer differs from the target's \\(2 tokens"):
        EngineConfig(model=str(target), speculative_config=draft_config(other))


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_draft_model_is_refused_with_several_processes(target, parallel):
    with pytest.raises(ValueError, match="tensor_parallel_size and pipeline_parallel_size 1 only"):
        EngineConfig(model=str(target), speculative_config=draft_config(target), **{parallel: 2})


def test_a_missing_draft_directory_is_a_clear_error(target, tmp_path):
    with pytest.raises(ValueError, match="speculative_config: draft model"):
        EngineConfig(model=str(target), speculative_config=draft_config(tmp_path / "nowhere"))


def test_the_engine_server_takes_a_draft_model_and_counts_it_in_metrics(target, small_draft, plain, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from portcullis.engine.server.cli import _engine_config, build_parser
    from tests.engine.server.conftest import start_server

    flag = json.dumps({"model": str(small_draft), "num_speculative_tokens": 3})  # no method: draft_model, as vLLM
    args = build_parser().parse_args([str(target), "--speculative-config", flag])
    assert _engine_config(args, str(target), "tiny").speculative_config.method == "draft_model"
    server = start_server(target, tmp_path, engine=dict(speculative_config=args.speculative_config))
    try:
        body = dict(model="tiny-llama", prompt=PROMPTS[2], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        text = server.client().completions.create(**body).choices[0].text
        with server.http() as http:
            metrics = {s.name + str(s.labels.get("position", "")): s.value
                       for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples}
    finally:
        server.stop()
    assert text == plain.generate([PROMPTS[2]], SamplingParams(**{k: body[k] for k in ("max_tokens", "temperature")},
                                                               ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens_total"], metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and metrics["vllm:spec_decode_num_drafts_total"] > 0
    per_position = [v for k, v in metrics.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    assert len(per_position) == 3 and accepted == sum(per_position)  # one series per draft position


def test_the_engine_command_refuses_a_mismatched_draft_before_serving(target, tmp_path):
    from portcullis.engine.server.cli import UsageError, _engine_config, build_parser

    other = build_checkpoint("qwen2", tmp_path / "v", vocab_size=4000, num_hidden_layers=1)
    args = build_parser().parse_args([str(target), "--speculative-config", json.dumps({"model": str(other)})])
    # (main() prints this after "engine: " and exits non-zero; calling it here would rebind the
    # process's log output to pytest's captured stderr.)
    with pytest.raises(UsageError, match="vocabulary has 4000 tokens and the target's 4096"):
        _engine_config(args, str(target), "tiny")
