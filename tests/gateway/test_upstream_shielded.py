"""`gateway.upstream.forward.shielded`, which drives a coroutine by hand (`send`, `throw`) to skip
a cancel scope when it never waits: what the exchange relies on when it settles limits and
closes an engine response under cancellation."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from portcullis.gateway.upstream.forward import shielded


class Gate:
    """Where the coroutine waits: `reached` once it waits there, `opened` lets it go on."""

    def __init__(self) -> None:
        self.reached, self.opened = anyio.Event(), anyio.Event()


async def settle(log: list[str], gate: Gate | None = None, error: Exception | None = None) -> None:
    """Stands for settling limits or closing a response: waits at `gate` (if any), then ends."""
    try:
        if gate is not None:
            gate.reached.set()
            await gate.opened.wait()
        if error is not None:
            raise error
        log.append("settled")
    finally:
        log.append("closed")


async def test_a_coroutine_that_never_waits_runs_whole_even_in_a_cancelled_scope():
    log: list[str] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await shielded(settle(log))
    assert log == ["settled", "closed"]


async def test_a_cancellation_lands_only_after_the_coroutine_finished():
    log: list[str] = []
    gate = Gate()

    async def request() -> None:
        try:
            await shielded(settle(log, gate))
            log.append("after")
            await anyio.sleep(1)
        except anyio.get_cancelled_exc_class():
            log.append("cancelled")
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await gate.reached.wait()
        tg.cancel_scope.cancel()
        gate.opened.set()
    assert log == ["settled", "closed", "after", "cancelled"]


@pytest.mark.parametrize("waits", [False, True])
async def test_the_coroutine_s_error_passes_through(waits):
    log: list[str] = []
    gate = Gate()
    gate.opened.set()
    with pytest.raises(KeyError, match="lost"):
        await shielded(settle(log, gate if waits else None, KeyError("lost")))
    assert log == ["closed"]


async def test_an_exception_thrown_at_its_first_wait_reaches_the_coroutine():
    """A plain asyncio cancel is not held back by anyio's shield: it is thrown into the coroutine,
    whose clean-up runs, and passes on; never dropped, the coroutine never left suspended."""
    log: list[str] = []
    gate = Gate()
    task = asyncio.create_task(shielded(settle(log, gate)))
    await gate.reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["closed"]
