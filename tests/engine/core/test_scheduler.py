"""Scheduler invariants under random streams of add / step / abort (hypothesis), with a fake model,
with and without speculative decoding, n-gram or draft model (the fake model accepts a random
prefix of each proposal, and drafts random tokens for the slots the scheduler gave a draft)."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portcullis.engine.config import SchedulerConfig, SpeculativeConfig
from portcullis.engine.core.kv_cache import KVCacheManager
from portcullis.engine.core.scheduler import Scheduler
from portcullis.engine.outputs import ModelRunnerOutput
from portcullis.engine.sampling_params import SamplingParams

BS = 4
MAX_LEN = 64

actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


def check_invariants(sched: Scheduler, out, budget: int, max_seqs: int) -> None:
    kv = sched.kv
    assert out.total_tokens <= budget
    assert len(sched.running) <= max_seqs
    for req in sched.running:
        assert len(kv.req_blocks[req.request_id][0]) * BS >= req.num_computed_tokens
    kv.check_integrity()


# KV-cache groups by sliding window (None: full attention): one full group, one sliding group
# (Mistral), and full and sliding groups mixed (Gemma).
GROUPS = [(None,), (6,), (None, 6), (9, None, 9)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions, st.integers(4, 24), st.integers(1, 6), st.integers(4, 48), st.booleans(),
       st.sampled_from([None, "ngram", "draft_model"]), st.sampled_from(GROUPS), st.randoms())
def test_random_streams_keep_invariants(ops, num_blocks, max_seqs, budget, caching, speculate, windows, rnd):
    kv = KVCacheManager(num_blocks, BS, caching, windows)
    spec = None if speculate is None else SpeculativeConfig(
        method=speculate, num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1,
        model="draft" if speculate == "draft_model" else None)
    sched = Scheduler(SchedulerConfig(max_seqs, budget, MAX_LEN, speculative=spec), kv)
    ids = 0
    # Few distinct tokens: proposals are found often.
    prefixes = [[rnd.randrange(8) for _ in range(24)] for _ in range(4)]
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prefix = op
            prompt = (prefixes[prefix] + [rnd.randrange(1000) for _ in range(plen)])[:plen]
            max_tokens = min(max_tokens, MAX_LEN - plen)
            if kv.max_blocks_of(plen + max_tokens, budget) > num_blocks:
                continue  # the engine refuses such a request at add_request
            sched.add(f"r{ids}", prompt, SamplingParams(max_tokens=max_tokens))
            ids += 1
        elif op[0] == "abort":
            sched.abort(f"r{op[1]}")
        else:
            for _ in range(op[1]):
                step(sched, rnd, budget, max_seqs)
    # Drain: everything finishes, and then every block is free (cached ones included).
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step(sched, rnd, budget, max_seqs)
    assert not sched.has_unfinished()
    assert kv.pool.num_free == kv.pool.num_blocks
    assert not kv.req_blocks


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions, st.integers(4, 24), st.integers(1, 6), st.integers(4, 48), st.booleans(),
       st.sampled_from([None, "ngram"]), st.sampled_from(GROUPS), st.randoms())
def test_random_streams_with_steps_in_flight_keep_invariants(ops, num_blocks, max_seqs, budget, caching, speculate,
                                                              windows, rnd):
    """As pipeline stages run it (`EngineCore`'s batch queue): up to two plans in flight, each
    applied later in order; a request in flight is neither planned again nor preempted, and one
    aborted in flight is skipped when its plan is applied."""
    kv = KVCacheManager(num_blocks, BS, caching, windows)
    spec = None if speculate is None else SpeculativeConfig(
        method=speculate, num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    sched = Scheduler(SchedulerConfig(max_seqs, budget, MAX_LEN, speculative=spec), kv)
    queue: list = []
    holds: set[str] = set()  # what a runner fed only the plans that run would still hold
    ids = 0
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, _ = op
            max_tokens = min(max_tokens, MAX_LEN - plen)
            if kv.max_blocks_of(plen + max_tokens, budget) <= num_blocks:
                sched.add(f"r{ids}", [rnd.randrange(8) for _ in range(plen)], SamplingParams(max_tokens=max_tokens))
                ids += 1
        elif op[0] == "abort":
            sched.abort(f"r{op[1]}")
        else:
            for _ in range(op[1]):
                pipelined_step(sched, queue, rnd, budget, max_seqs, holds)
    for _ in range(2000):
        if not (sched.has_unfinished() or queue):
            break
        pipelined_step(sched, queue, rnd, budget, max_seqs, holds)
    assert not sched.has_unfinished() and not queue
    assert kv.pool.num_free == kv.pool.num_blocks
    assert not kv.req_blocks
    assert holds == set(sched._released)  # every release reaches the runner with the next plan that runs


def pipelined_step(sched: Scheduler, queue: list, rnd: random.Random, budget: int, max_seqs: int,
                   holds: set[str]) -> None:
    if len(queue) < 2:
        in_flight = {rid for out, _ in queue for rid in out.request_ids}
        out = sched.schedule()
        check_invariants(sched, out, budget, max_seqs)
        assert not in_flight & set(out.request_ids)
        assert all(sched.requests[rid].status.name == "RUNNING" for rid in in_flight if rid in sched.requests)
        if out.num_scheduled:  # as the engine: a plan that schedules nothing is not run
            holds.difference_update(out.released_ids)
            holds.update(n.request_id for n in out.new)
            queue.append((out, model_tokens(sched, out, rnd)))
            if len(queue) < 2:
                return
    if queue:
        out, tokens = queue.pop(0)
        sched.update(out, ModelRunnerOutput(tokens, [None] * len(tokens)))
        check_invariants(sched, out, budget, max_seqs)


def model_tokens(sched: Scheduler, out, rnd: random.Random) -> list[list[int]]:
    """What a fake model makes of `out`: for each request that reaches the end of its tokens, a
    random prefix of its proposals accepted and one token more."""
    proposals = {c.request_id: [*c.spec_token_ids, *(rnd.randrange(8) for _ in range(c.num_draft_tokens))]
                 for c in out.cached}
    tokens = []
    for rid, n in zip(out.request_ids, out.num_scheduled_tokens):
        req = sched.requests[rid]
        spec = proposals.get(rid, [])
        done = req.num_computed_tokens + n - len(spec) == req.num_tokens
        accepted = rnd.randint(0, len(spec))
        tokens.append([*spec[:accepted], rnd.randrange(8)] if done else [])
    return tokens


def step(sched: Scheduler, rnd: random.Random, budget: int, max_seqs: int) -> None:
    out = sched.schedule()
    check_invariants(sched, out, budget, max_seqs)
    for rid in out.request_ids:  # a sliding group holds no block wholly before its window
        req, tables = sched.requests[rid], sched.kv.req_blocks[rid]
        for window, blocks in zip(sched.kv.sliding_windows, tables):
            if window is not None:
                first = max(0, req.num_computed_tokens - window + 1) // BS
                assert all(b is None for b in blocks[:first]) and all(b is not None for b in blocks[first:])
    tokens = model_tokens(sched, out, rnd)  # a draft model's proposals are made in the runner: here, random tokens
    sched.update(out, ModelRunnerOutput(tokens, [None] * len(tokens)))
    check_invariants(sched, out, budget, max_seqs)
    for req in sched.running:  # rejected proposals' KV is not counted as computed
        assert req.num_computed_tokens <= req.num_tokens - 1 or req.num_computed_tokens < req.num_prompt_tokens


def update(sched: Scheduler, out, sampled: list[int | None]) -> None:
    """What a model runner would hand back: these tokens (None: none), no logprobs."""
    sched.update(out, ModelRunnerOutput([[] if t is None else [t] for t in sampled], [None] * len(sampled)))


def test_preempts_most_recently_admitted():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN), kv)
    old = sched.add("old", [1] * 4, SamplingParams(max_tokens=8))
    new = sched.add("new", [2] * 4, SamplingParams(max_tokens=8))
    out = sched.schedule()  # both prefill: 1 block each
    update(sched, out, [7, 7])  # 5 tokens each: each needs a second block at its next step
    out = sched.schedule()
    update(sched, out, [7] * out.num_scheduled)
    out = sched.schedule()  # 6 tokens each -> 2 blocks each -> 4 blocks: fits; grow until it does not
    update(sched, out, [7] * out.num_scheduled)
    for _ in range(4):
        out = sched.schedule()
        if out.num_preempted:
            break
        update(sched, out, [7] * out.num_scheduled)
    assert out.num_preempted == 1
    assert sched.waiting.peek() is new and new.num_computed_tokens == 0
    assert sched.running == [old]
    assert sched.stats.num_preemptions == 1


def test_decodes_scheduled_before_new_prefills_within_budget():
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=MAX_LEN), kv)
    sched.add("a", list(range(8)), SamplingParams(max_tokens=4))
    out = sched.schedule()
    update(sched, out, [5])
    sched.add("b", list(range(30)), SamplingParams(max_tokens=4))
    out = sched.schedule()
    assert list(zip(out.request_ids, out.num_scheduled_tokens)) == [("a", 1), ("b", 9)]  # chunked
