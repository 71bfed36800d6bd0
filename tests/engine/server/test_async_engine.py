"""`AsyncEngine`: one thread owns the core, sleeps when idle, and reports each request's fate to
its own caller only. A scripted stand-in for `EngineCore` keeps these fast and exact."""
from __future__ import annotations

import asyncio

import pytest

from portcullis.engine.core.scheduler import SchedulerStats
from portcullis.engine.frontend.async_engine import AsyncEngine, EngineDeadError, EngineRequest
from portcullis.engine.outputs import StepOutput
from portcullis.engine.sampling_params import SamplingParams


class ScriptedCore:
    """Each request emits tokens 100, 101, ... one per step until max_tokens, then "length"."""

    def __init__(self, fail_on_step: int | None = None):
        self.requests: dict[str, list] = {}
        self.steps = 0
        self.polls = 0
        self.fail_on_step = fail_on_step
        self.stats = SchedulerStats()
        self.shut_down = False

    def add_request(self, request_id, prompt, params, cache_salt=None, arrival_time=None, **_):
        if not prompt:
            raise ValueError("the prompt is empty")
        if request_id in self.requests:
            raise ValueError("already in use")
        self.requests[request_id] = [prompt, params.max_tokens, 0]
        return request_id

    def step(self):
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("kernel exploded")
        outs = []
        for rid, r in list(self.requests.items()):
            r[2] += 1
            done = r[2] >= r[1]
            outs.append(StepOutput(rid, [99 + r[2]], "length" if done else None, len(r[0]), 0, r[2]))
            if done:
                del self.requests[rid]
        return outs

    def abort(self, ids):
        outs = []
        for rid in ids:
            if rid in self.requests:
                r = self.requests.pop(rid)
                outs.append(StepOutput(rid, [], "abort", len(r[0]), 0, r[2]))
        return outs

    def has_unfinished_requests(self):
        self.polls += 1
        return bool(self.requests)

    num_running = property(lambda self: len(self.requests))
    num_waiting = 0

    def kv_cache_usage(self):
        return 0.0

    def shutdown(self):
        self.shut_down = True


def req(rid: str, prompt=(1, 2), max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


async def collect(stream) -> list[StepOutput]:
    return [out async for out in stream]


@pytest.fixture
async def engine():
    core = ScriptedCore()
    eng = AsyncEngine(core)
    eng.start()
    yield eng
    await eng.shutdown()


async def test_outputs_reach_their_own_stream_in_order(engine):
    a, b = await engine.add([req("a", max_tokens=3)]), await engine.add([req("b", max_tokens=5)])
    outs_a, outs_b = await asyncio.gather(collect(a), collect(b))
    assert [o.new_token_ids[0] for o in outs_a] == [100, 101, 102] and outs_a[-1].finish_reason == "length"
    assert len(outs_b) == 5 and {o.request_id for o in outs_b} == {"b"}


async def test_one_stream_carries_all_choices_of_a_call(engine):
    stream = await engine.add([req("x-0", max_tokens=2), req("x-1", max_tokens=4)])
    outs = await collect(stream)
    assert sum(o.finished for o in outs) == 2 and len(outs) == 6


async def test_refused_add_fails_that_caller_only_and_queues_nothing(engine):
    good = await engine.add([req("ok", max_tokens=2)])
    with pytest.raises(ValueError, match="empty"):
        await engine.add([req("p-0"), req("p-1", prompt=())])  # all or none
    assert "p-0" not in engine.core.requests
    assert len(await collect(good)) == 2
    again = await engine.add([req("p-0", max_tokens=1)])  # the id is free again
    assert len(await collect(again)) == 1


async def test_idle_engine_sleeps_instead_of_polling(engine):
    await collect(await engine.add([req("a", max_tokens=2)]))
    await asyncio.sleep(0.05)
    polls, steps = engine.core.polls, engine.core.steps
    await asyncio.sleep(0.3)
    assert (engine.core.polls, engine.core.steps) == (polls, steps)
    assert len(await collect(await engine.add([req("b", max_tokens=2)]))) == 2  # and wakes up


async def test_abort_ends_the_stream_with_abort(engine):
    stream = await engine.add([req("long", max_tokens=10**6)])
    first = await stream.__aiter__().__anext__()
    assert first.new_token_ids == [100]
    engine.abort(["long"])
    outs = await collect(stream)
    assert outs[-1].finish_reason == "abort" and "long" not in engine.core.requests


async def test_crash_fails_every_stream_and_every_later_add():
    core = ScriptedCore(fail_on_step=3)
    eng = AsyncEngine(core)
    eng.start()
    stream = await eng.add([req("a", max_tokens=10)])
    with pytest.raises(EngineDeadError, match=r"internal error \(RuntimeError\)") as dead:
        await collect(stream)
    assert "kernel exploded" not in str(dead.value)  # clients hear the type, the log has the message
    assert str(dead.value.__cause__) == "kernel exploded"
    assert not eng.is_alive
    with pytest.raises(EngineDeadError):
        await eng.add([req("b")])
    await eng.shutdown()
    assert core.shut_down


async def test_a_crash_while_adding_answers_the_caller():
    # The request being added when the loop dies is already out of the inbox: its caller must
    # still hear that the engine is gone, not wait until the server gives up on it.
    core = ScriptedCore()

    def broken(*_args, **_kw):
        raise RuntimeError("allocator exploded")

    core.add_request = broken
    eng = AsyncEngine(core)
    eng.start()
    with pytest.raises(EngineDeadError, match=r"internal error \(RuntimeError\)"):
        await asyncio.wait_for(eng.add([req("a")]), timeout=5)
    assert isinstance(eng.failure, RuntimeError) and str(eng.failure) == "allocator exploded"
    await eng.shutdown()


async def test_shutdown_ends_streams_in_flight():
    eng = AsyncEngine(ScriptedCore())
    eng.start()
    stream = await eng.add([req("a", max_tokens=10**6)])
    await eng.shutdown()
    with pytest.raises(EngineDeadError, match="shutting down"):
        await collect(stream)


async def test_a_live_request_id_cannot_be_reused(engine):
    first = await engine.add([req("same", max_tokens=10**6)])
    with pytest.raises(ValueError, match="already in use"):
        await engine.add([req("same")])
    engine.abort(["same"])
    outs = await collect(first)  # the first was untouched until its abort
    assert outs[-1].finish_reason == "abort" and len(outs) > 1
    assert len(await collect(await engine.add([req("same", max_tokens=1)]))) == 1  # free again
