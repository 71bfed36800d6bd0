"""Priority scheduling: lower `priority` values are admitted first, the lowest-priority running
request is preempted first, and waiting ages a request so nothing waits for ever."""
from __future__ import annotations

import time

import pytest

from portcullis.engine import LLM, RequestError, SamplingParams
from portcullis.engine.config import SchedulerConfig
from portcullis.engine.core.kv_cache import KVCacheManager
from portcullis.engine.core.scheduler import Scheduler
from portcullis.engine.core.waiting_queue import PRIORITY_AGING_S
from portcullis.engine.outputs import ModelRunnerOutput

BS = 4


def run_step(sched: Scheduler) -> list[str]:
    """One step with a stand-in model (every finished prefill or decode samples token 7); the
    ids of the requests that finished in it."""
    out = sched.schedule()
    sampled = []
    for rid, n in zip(out.request_ids, out.num_scheduled_tokens):
        req = sched.requests[rid]
        sampled.append(7 if req.num_computed_tokens + n == req.num_tokens else None)
    tokens = [[] if t is None else [t] for t in sampled]
    return [o.request_id for o in sched.update(out, ModelRunnerOutput(tokens, [None] * len(sampled))) if o.finished]


def finish_order(sched: Scheduler) -> list[str]:
    order = []
    while sched.has_unfinished():
        order += run_step(sched)
    return order


def test_a_high_priority_request_overtakes_a_queue_of_low_ones():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                                      policy="priority"), KVCacheManager(64, BS))
    for i in range(4):
        sched.add(f"batch-{i}", [1, 2, 3], SamplingParams(max_tokens=3), priority=10)
    run_step(sched)  # batch-0 is running now
    sched.add("ide", [4, 5, 6], SamplingParams(max_tokens=3), priority=0)
    assert finish_order(sched) == ["batch-0", "ide", "batch-1", "batch-2", "batch-3"]


def test_fcfs_keeps_arrival_order():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64), KVCacheManager(64, BS))
    for i in range(3):
        sched.add(f"batch-{i}", [1, 2, 3], SamplingParams(max_tokens=3))
    run_step(sched)
    sched.add("ide", [4, 5, 6], SamplingParams(max_tokens=3))
    assert finish_order(sched) == ["batch-0", "batch-1", "batch-2", "ide"]


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_the_lowest_priority_running_request_is_preempted_first(policy, victim):
    # Four blocks: two requests of one block each; growing past four blocks forces a preemption.
    # "low" is admitted first, so FCFS (most recently admitted goes) preempts "high" instead.
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                      policy=policy), KVCacheManager(4, BS))
    sched.add("low", [1] * 4, SamplingParams(max_tokens=8), priority=5)
    sched.add("high", [2] * 4, SamplingParams(max_tokens=8), priority=0)
    for _ in range(6):
        run_step(sched)
        if sched.stats.num_preemptions:
            break
    assert sched.stats.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == [victim]
    assert [r.request_id for r in sched.running] == [{"low": "high", "high": "low"}[victim]]


def test_waiting_ages_a_request_past_newer_urgent_ones():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                                      policy="priority"), KVCacheManager(64, BS))
    now = time.monotonic()
    # Waited eleven levels' worth of time at priority 10: now ahead of a fresh priority-0 request.
    sched.add("old-batch", [1, 2], SamplingParams(max_tokens=2), priority=10, arrival_time=now - 11 * PRIORITY_AGING_S)
    sched.add("fresh-ide", [3, 4], SamplingParams(max_tokens=2), priority=0, arrival_time=now)
    # One that has waited only nine levels' worth stays behind the urgent one.
    sched.add("young-batch", [5, 6], SamplingParams(max_tokens=2), priority=10, arrival_time=now - 9 * PRIORITY_AGING_S)
    assert finish_order(sched) == ["old-batch", "fresh-ide", "young-batch"]


def test_abort_of_a_waiting_request_under_priority():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                                      policy="priority"), KVCacheManager(64, BS))
    for i, p in enumerate((3, 1, 2)):
        sched.add(f"r{i}", [1, 2], SamplingParams(max_tokens=2), priority=p)
    assert sched.abort("r1").finish_reason == "abort"
    assert len(sched.waiting) == 2 and [r.request_id for r in sched.waiting] == ["r2", "r0"]
    assert finish_order(sched) == ["r2", "r0"]


def test_engine_refuses_priority_without_the_policy(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    plain = LLM(path, max_model_len=128, kv_cache_memory=8 << 20)
    try:
        plain.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), priority=1)
    except RequestError as exc:
        assert exc.param == "priority" and "--scheduling-policy priority" in str(exc)
    else:
        raise AssertionError("priority was accepted by an FCFS engine")
    ranked = LLM(path, max_model_len=128, kv_cache_memory=8 << 20, scheduling_policy="priority", max_num_seqs=1)
    ranked.engine.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), priority=9)
    ranked.engine.add_request("urgent", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), priority=0)
    done = []
    while ranked.engine.has_unfinished_requests():
        done += [o.request_id for o in ranked.engine.step() if o.finished]
    assert done == ["urgent", "late"]
