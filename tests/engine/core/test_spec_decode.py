"""N-gram speculative decoding: what is proposed, that verification leaves the output exactly as
without speculation (greedy, seeded, with penalties, logprobs, stops and max_tokens), and that
unseeded draws keep the model's distribution."""
from __future__ import annotations

import json
from array import array

import pytest
import torch

from portcullis.engine import LLM, SamplingParams
from portcullis.engine.config import SchedulerConfig, SpeculativeConfig
from portcullis.engine.core.spec_decode import propose, propose_from_prediction
from portcullis.engine.worker.model_runner import _accepted
from portcullis.engine.worker.sampler import BatchSamplingArgs, sample

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_proposals_follow_the_latest_longest_match():
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], cfg, 5) == [4, 5, 9]  # the 3-gram 1 2 3
    assert propose([7, 3, 8, 1, 3, 9, 3], cfg, 5) == [9, 3]  # only the 1-gram "3": its latest match
    assert propose([1, 2, 3, 4], cfg, 5) == []
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], cfg, 2) == [4, 5]  # the caller's limit
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], cfg, 0) == []
    # 256 then 0 hold the bytes of token 1 at an odd offset (00 [01 00 00 | 00] 00 00 00): that
    # later, misaligned "match" is skipped for the real one at the start.
    assert propose([1, 9, 256, 0, 1], cfg, 3) == [9, 256, 0]


def test_a_context_packed_as_it_grows_proposes_as_a_fresh_packing_does():
    # The scheduler keeps each request's tokens packed and extends them as they grow.
    import random

    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    rng = random.Random(0)
    for _ in range(50):
        tokens, packed = [rng.randrange(6) for _ in range(rng.randrange(1, 20))], bytearray()
        for _ in range(30):
            assert propose(tokens, cfg, 4, packed) == propose(tokens, cfg, 4)
            assert packed == array("i", tokens).tobytes()
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 3))]


def _naive_lookup(source: list[int], context: list[int], n_max: int, n_min: int, k: int, exclude_tail: bool):
    """The lookup's contract, token by token: what follows the latest earlier occurrence of the
    longest suffix of `context` (n_max..n_min tokens) in `source`, with a token after it."""
    for n in range(min(n_max, len(context) - exclude_tail), n_min - 1, -1):
        suffix = context[-n:]
        for start in range(len(source) - n - 1, -1, -1):
            if source[start : start + n] == suffix:
                return source[start + n : start + n + k]
    return []


def test_proposals_match_a_token_by_token_search_where_bytes_match_across_tokens():
    # Ids whose 4-byte forms line up across token boundaries (1 inside 256 256, 0 inside 0 and
    # 256): a misaligned byte match at almost every token, then a real match further back or none.
    import random

    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    rng = random.Random(1)
    alphabets = ([0, 1, 256, 65536, 1 << 24], [1, 256], list(range(6)), list(range(50_000)))
    for _ in range(300):
        alphabet = rng.choice(alphabets)
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.5:  # a run of misaligned matches between the end and the real one
            tokens = tokens + [256] * rng.randrange(1, 60) + [1]
        assert propose(tokens, cfg, 4) == _naive_lookup(tokens, tokens, 3, 1, 4, True), tokens
        output = [rng.choice([1, 2, 256]) for _ in range(rng.randrange(1, 12))]
        assert propose_from_prediction(tokens, output, None, 8) == (
            tokens[len(output) : len(output) + 8]
            if tokens[max(0, len(output) - 8) : len(output)] == output[-8:] and len(output) < len(tokens)
            else _naive_lookup(tokens, output, 8, 1, 8, False)), (tokens, output)


def _operations(fn) -> int:
    """Python and C function calls made while `fn` runs: the lookup's work outside the C scans."""
    import sys

    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("length", [2040, 8160])
def test_a_lookup_built_to_match_across_tokens_costs_a_bounded_number_of_operations(length):
    # Issue 29, finding 4: a prediction of 2,040 x token 256 while allowed_token_ids forces token 1.
    # Packed as bytes, 1 1 1 occurs across every boundary of 256 256 256 (00 01 00 00 | 00 01 ...),
    # and the search stepped through each such match in Python, 8 suffix lengths a step: 3 ms a
    # lookup on the engine thread, for every stream that asked, 5-7x every tenant's time per token.
    # Bounded whatever the length (was 32,588 operations at 2,040 tokens, 130,508 at 8,160).
    prediction, forced = [256] * length, [1] * 40
    assert propose_from_prediction(prediction, forced, None, 8) == []
    assert _operations(lambda: propose_from_prediction(prediction, forced, None, 8)) <= 1000
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4)  # the n-gram path: same search
    context = [256] * length + [1]
    assert propose(context, cfg, 4) == []
    assert _operations(lambda: propose(context, cfg, 4, bytearray())) <= 1000  # was 4,111 and 16,351


@pytest.mark.parametrize("bad", ['{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"num_speculative_tokens": "4"}',
                                 '{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', '{"k": 4}', "not json"])
def test_bad_speculative_configs_are_refused(bad):
    with pytest.raises(ValueError):
        SpeculativeConfig.parse(bad)


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    path = str(checkpoint_factory("qwen2"))
    plain = LLM(path, max_model_len=512, kv_cache_memory=32 << 20, seed=0)
    spec = LLM(path, max_model_len=512, kv_cache_memory=32 << 20, seed=0, speculative_config=NGRAM)
    return plain, spec


PROMPTS = [[5, 6, 7, 8] * 6, list(range(100, 140)), [11, 12] * 20, [300, 301, 302, 5, 6, 7, 300, 301]]


@pytest.mark.parametrize("params", [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3),
    dict(temperature=0.9, top_p=0.9, seed=11, logprobs=2),
    dict(temperature=1.0, top_k=20, seed=5, presence_penalty=0.7, min_tokens=10),
])
def test_outputs_are_identical_with_and_without_speculation(engines, params):
    plain, spec = engines
    sp = SamplingParams(max_tokens=40, ignore_eos=True, **params)
    before = spec.engine.stats.spec_num_draft_tokens
    want = plain.generate(PROMPTS, sp, use_tqdm=False)
    got = spec.generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == 40  # max_tokens holds whatever was accepted
        if sp.logprobs is not None:
            assert [lp.token_id for lp in b.outputs[0].logprobs] == b.outputs[0].token_ids
            assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
    assert spec.engine.stats.spec_num_draft_tokens > before  # proposals were made and verified
    spec.engine.kv.pool.check_integrity()


def test_stop_tokens_and_strings_inside_an_accepted_run(engines):
    plain, spec = engines
    free = plain.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    stop_id = ids[12]  # a token the model emits mid-way: generation must end right there
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id])
    for llm in (plain, spec):
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ids[: ids.index(stop_id) + 1] and out.finish_reason == "stop"


def test_unseeded_verification_keeps_the_distribution():
    # 20,000 requests with one 8-token row each: proposal 3 at the first position. The first
    # emitted token must follow the model's distribution, and proposal 3 be accepted with p(3).
    torch.manual_seed(0)
    row = torch.randn(2, 8) * 1.5
    n = 20_000
    params = SamplingParams(temperature=1.0)
    rows = 2 * n
    args = BatchSamplingArgs(params=[params] * rows, num_outputs=[0, 1] * n, eos_token_ids=[()] * rows,
                             output_token_ids=[None] * rows, prompt_ids=[None] * rows)
    tokens = sample(row.repeat(n, 1), args, torch.Generator().manual_seed(1)).token_ids
    firsts, accepted = [], 0
    for i in range(n):
        drawn = tokens[2 * i : 2 * i + 2]
        kept = _accepted([3], drawn)
        accepted += kept
        firsts.append(drawn[0])
    p = row[0].softmax(-1)
    freq = torch.bincount(torch.tensor(firsts), minlength=8).float() / n
    err = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() <= 5 * err + 1e-4).all())
    assert abs(accepted / n - float(p[3])) <= 5 * float(err[3]) + 1e-4


def test_a_perfect_prediction_is_accepted_whole(engines):
    plain, _ = engines  # no --speculative-config: a prediction alone turns verification on
    core = plain.engine
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = plain.generate(PROMPTS[1:2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    steps = 0
    core.add_request("predicted", PROMPTS[1], greedy, prediction=list(want))
    got = []
    while core.has_unfinished_requests():
        outs = core.step()
        steps += 1
        for out in outs:
            got += out.new_token_ids
            last = out
    assert got == want and last.num_accepted_prediction_tokens == 32
    assert steps <= 1 + -(-32 // 9)  # the prefill, then up to 8 proposals and one own token a step


def test_a_prediction_the_output_has_left_is_searched_less_and_less(engines, monkeypatch):
    """Issue 29, finding 4: a prediction the output never follows (allowed_token_ids forces
    another token) was searched twice for every token, proposing and counting accepted tokens,
    slowing every tenant's step. Now a failed search pauses the next for twice as long each time,
    and the count of accepted prediction tokens needs no search."""
    from portcullis.engine.core import spec_decode

    plain, _ = engines
    core, calls = plain.engine, []
    real = spec_decode._lookup
    monkeypatch.setattr(spec_decode, "_lookup", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    forced = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, allowed_token_ids=[9])
    core.add_request("astray", PROMPTS[1], forced, prediction=[256] * 400)
    while core.has_unfinished_requests():
        for out in core.step():
            last = out
    assert last.num_accepted_prediction_tokens == 0
    assert len(calls) <= 8, len(calls)  # 64 tokens: searched at pauses of 1, 2, 4 ... 32 steps


def test_no_proposals_while_the_batch_is_larger_than_disable_by_batch_size():
    from portcullis.engine.core.kv_cache import KVCacheManager
    from portcullis.engine.core.scheduler import Scheduler
    from portcullis.engine.outputs import ModelRunnerOutput

    cfg = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, disable_by_batch_size=2)
    sched = Scheduler(SchedulerConfig(8, 256, 128, speculative=cfg), KVCacheManager(64, 4))
    for i in range(3):
        sched.add(f"r{i}", [1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=10))

    def step() -> list:
        out = sched.schedule()
        tokens = [[*c.spec_token_ids, 1] for c in out.cached] + [[1] for _ in out.new]
        sched.update(out, ModelRunnerOutput(tokens, [None] * len(tokens)))
        return [c.spec_token_ids for c in out.cached]

    step()  # the three prefills
    assert [list(p) for p in step()] == [[], [], []]  # three running > 2: no proposals
    sched.abort("r2")
    assert all(len(p) >= 1 for p in step())  # two running: proposals again


def _one_ngram_request(max_tokens: int):
    """A scheduler with one n-gram request on a repeating prompt, and a step function for a fake
    model that accepts every proposal (continuing the pattern) or only the first `kept`."""
    from portcullis.engine.core.kv_cache import KVCacheManager
    from portcullis.engine.core.scheduler import Scheduler
    from portcullis.engine.outputs import ModelRunnerOutput

    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2)
    sched = Scheduler(SchedulerConfig(4, 256, 256, speculative=cfg), KVCacheManager(64, 4))
    req = sched.add("r", [1, 2, 3, 4, 5, 6, 7, 8] * 3, SamplingParams(max_tokens=max_tokens))

    def step(accept: bool, kept: int = 0) -> int:
        out = sched.schedule()
        spec = list(out.cached[0].spec_token_ids) if out.cached else []
        tokens = [*spec, spec[0] if spec else 1] if accept else ([*spec[:kept], 99] if spec else [1])
        sched.update(out, ModelRunnerOutput([tokens], [None]))
        return len(spec)

    return req, step


@pytest.fixture
def costly_proposals(monkeypatch):
    """Every step counts as big enough that proposals cost compute (a lone request's do not)."""
    from portcullis.engine.core import scheduler

    monkeypatch.setattr(scheduler, "FREE_ROWS", 0)


def test_a_lone_request_keeps_proposing_its_full_window_however_often_it_fails():
    from portcullis.engine.core.spec_decode import propose

    req, step = _one_ngram_request(120)
    step(True)  # the prefill
    sizes, found = [], []
    for _ in range(40):
        found.append(len(propose(req.all_token_ids, SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2), 4)))
        sizes.append(step(False))
    assert sizes == found and max(sizes) == 4  # neither cut by the window nor paused ...
    assert req.spec_window == 1 and req.spec_backoff > 0  # ... which a bigger step would have done


def test_a_pause_built_up_in_free_steps_does_not_outlive_them(monkeypatch):
    from portcullis.engine.core import scheduler

    req, step = _one_ngram_request(200)
    step(True)  # the prefill
    for _ in range(60):  # a lone request fails: it keeps proposing, and its back-off grows ...
        step(False)
    assert req.spec_pause > 0 and req.spec_backoff > 0
    assert step(True) > 0 and req.spec_pause == 0  # ... until its text repeats: an accepted run ends it
    monkeypatch.setattr(scheduler, "FREE_ROWS", 0)  # a second request arrives: proposals cost now
    assert step(True) > 0  # and this request, whose proposals pay, is not left paused


def test_the_proposal_window_halves_after_rejected_runs(costly_proposals):
    req, step = _one_ngram_request(60)
    step(True)  # the prefill
    sizes = [step(False) for _ in range(4)]
    assert sizes[0] == 4 and sizes[-1] <= 1 and req.spec_window == 1


def test_after_a_partly_accepted_run_the_window_is_one_more_than_was_kept(costly_proposals):
    req, step = _one_ngram_request(60)
    step(True)  # the prefill
    assert step(False, kept=1) == 4 and req.spec_window == 2  # 4 proposed, 1 kept: 2 next
    assert step(True) == 0  # the model's own token (99) is nowhere in the context: nothing to propose
    assert step(True) == 2 and req.spec_window == 3  # a match again: 2 proposed, both kept: 3 next
    assert step(False, kept=1) == 2 and req.spec_window == 2 and req.spec_pause == 0  # 2 proposed, 1 kept: no pause


def test_a_request_whose_single_proposals_fail_pauses_for_longer_each_time(costly_proposals):
    from portcullis.engine.core.scheduler import MAX_SPEC_PAUSE

    req, step = _one_ngram_request(200)
    step(True)  # the prefill
    sizes = [step(False) for _ in range(100)]
    proposing = [i for i, n in enumerate(sizes) if n]
    gaps = [b - a for a, b in zip(proposing, proposing[1:])]
    assert sizes[0] == 4 and max(sizes[proposing[2]:]) == 1  # the window halves down to one
    # ... then pauses that double, up to the cap: about log2(100) proposing steps, not 100
    assert gaps[2:] == sorted(gaps[2:]) and gaps[-2:] == [MAX_SPEC_PAUSE // 2 + 1, MAX_SPEC_PAUSE + 1]
    assert len(proposing) <= 12
    while req.spec_pause:  # once its text repeats again, a fully accepted run ends the back-off
        step(False)
    assert step(True) == 1 and req.spec_backoff == 0 and req.spec_window == 2


def test_blocks_past_a_rejected_run_are_freed_at_once():
    from portcullis.engine.core.kv_cache import KVCacheManager
    from portcullis.engine.core.scheduler import Scheduler
    from portcullis.engine.outputs import ModelRunnerOutput

    kv = KVCacheManager(16, 4)
    sched = Scheduler(SchedulerConfig(4, 256, 256, speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2)), kv)
    req = sched.add("r", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=20))
    sched.update(out := sched.schedule(), ModelRunnerOutput([[1]], [None]))  # the prefill: 7 tokens, 2 blocks
    out = sched.schedule()
    assert list(out.cached[0].spec_token_ids) == [2, 3, 1] and kv.num_blocks_of(req) == 3  # slots up to position 9
    sched.update(out, ModelRunnerOutput([[99]], [None]))  # all rejected: 8 tokens fill 2 blocks
    assert kv.num_blocks_of(req) == 2 and kv.pool.num_free == 14
    kv.pool.check_integrity()
    out = sched.schedule()  # the next step allocates what it needs again
    assert kv.num_blocks_of(req) * 4 >= req.num_computed_tokens + out.cached[0].num_tokens


# ---- proposals under a grammar: only those it allows are verified, one bitmask row each --------

LIST_SCHEMA = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "size": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "size"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def demo_engines():
    from portcullis.engine.assets import DEMO_MODEL_DIR

    plain = LLM(str(DEMO_MODEL_DIR), max_model_len=512, kv_cache_memory=64 << 20, seed=0)
    spec = LLM(str(DEMO_MODEL_DIR), max_model_len=512, kv_cache_memory=64 << 20, seed=0, speculative_config=NGRAM)
    return plain, spec


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.8, seed=3)])
def test_structured_output_with_speculation_is_identical_and_verifies_proposals(demo_engines, params):
    """Repeated keys give n-gram matches; the grammar cuts each run at its first refused token and
    every verified position samples under its own state, so outputs equal plain decoding's."""
    from portcullis.engine.sampling_params import StructuredOutputsParams

    plain, spec = demo_engines
    sp = SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=LIST_SCHEMA), **params)
    prompts = ["inventory = ", "# the team\nmembers = "]
    stats = spec.engine.stats
    before = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    want = plain.generate(prompts, sp, use_tqdm=False)
    got = spec.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == "stop" and len(json.loads(b.outputs[0].text)) == 4
    assert stats.spec_num_draft_tokens > before[0] and stats.spec_num_accepted_tokens > before[1]
    spec.engine.kv.pool.check_integrity()


def test_a_perfect_prediction_under_a_grammar_is_accepted_whole(demo_engines):
    from portcullis.engine.sampling_params import StructuredOutputsParams

    plain, _ = demo_engines
    sp = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=LIST_SCHEMA))
    want = plain.generate(["inventory = "], sp, use_tqdm=False)[0].outputs[0].token_ids
    core = plain.engine
    core.add_request("predicted-json", plain.tokenizer.encode("inventory = "), sp,
                     grammar=plain.compile_grammar(sp), prediction=list(want))
    got, last = [], None
    while core.has_unfinished_requests():
        for out in core.step():
            got += out.new_token_ids
            last = out
    assert got == want and last.num_accepted_prediction_tokens == len(want)
