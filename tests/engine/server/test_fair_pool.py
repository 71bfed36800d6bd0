"""The tokenizer and grammar threads' queue: tenants take turns, and each queue is bounded in
length and in waiting time (issue 29: one tenant's heavy requests must not starve the others)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from portcullis.engine.server.errors import APIError
from portcullis.engine.server.fair_pool import FairPool


@pytest.fixture
def gate():
    """A job that holds the worker thread until the test opens the gate."""
    event = threading.Event()
    yield event
    event.set()


async def _started(pool: FairPool, tenant: str, fn, *args) -> asyncio.Task:
    task = asyncio.create_task(pool.run(tenant, fn, *args))
    await asyncio.sleep(0)  # queued in the order the tasks were made
    return task


async def test_tenants_take_turns_whatever_one_of_them_queued(gate):
    pool = FairPool("test")
    ran: list[str] = []
    blocker = await _started(pool, "hostile", gate.wait)
    hostile = [await _started(pool, "hostile", ran.append, f"hostile-{i}") for i in range(5)]
    victim = await _started(pool, "victim", ran.append, "victim")
    gate.set()
    await asyncio.gather(blocker, victim, *hostile)
    # The victim came after five of the hostile tenant's jobs, yet it waited for one of them.
    assert ran == ["hostile-0", "victim", "hostile-1", "hostile-2", "hostile-3", "hostile-4"]
    pool.shutdown()


async def test_a_tenant_over_its_queue_is_told_to_retry_and_others_are_not(gate):
    pool = FairPool("test", max_queued_per_tenant=2)
    blocker = await _started(pool, "hostile", gate.wait)
    queued = [await _started(pool, "hostile", int, "1") for _ in range(2)]
    with pytest.raises(APIError) as refused:
        await pool.run("hostile", int, "1")
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert "this tenant" in refused.value.message
    other = await _started(pool, "victim", int, "7")
    gate.set()
    assert await other == 7
    assert await asyncio.gather(*queued) == [1, 1]
    await blocker
    assert pool.queued == 0
    pool.shutdown()


async def test_the_pool_as_a_whole_is_bounded(gate):
    pool = FairPool("test", max_queued=3)
    blocker = await _started(pool, "a", gate.wait)
    queued = [await _started(pool, name, int, "1") for name in ("a", "b", "c")]
    with pytest.raises(APIError, match="too many requests"):
        await pool.run("d", int, "1")
    gate.set()
    await asyncio.gather(blocker, *queued)
    pool.shutdown()


async def test_a_job_that_waited_too_long_is_refused_not_run(gate):
    pool = FairPool("test", max_wait_s=0.05)
    ran: list[int] = []
    blocker = await _started(pool, "a", gate.wait)
    late = await _started(pool, "b", ran.append, 1)
    await asyncio.sleep(0.1)
    gate.set()
    await blocker
    with pytest.raises(APIError) as refused:
        await late
    assert refused.value.status == 503 and "waited too long" in refused.value.message
    assert ran == []
    assert await pool.run("b", int, "5") == 5  # a fresh job runs
    pool.shutdown()


async def test_errors_reach_the_caller_and_a_cancelled_caller_costs_nothing(gate):
    pool = FairPool("test")
    ran: list[int] = []
    blocker = await _started(pool, "a", gate.wait)
    gone = await _started(pool, "b", ran.append, 1)
    gone.cancel()
    gate.set()
    await blocker
    with pytest.raises(ValueError, match="invalid literal"):
        await pool.run("a", int, "x")
    assert ran == [] and pool.queued == 0
    pool.shutdown()
