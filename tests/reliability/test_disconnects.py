"""A client that goes away in any phase frees its KV blocks: before the response head
(non-streamed), during prefill, and mid-stream; talking to the real engine directly and
through the gateway. The engine's own gauges are the judge: nothing running or waiting and
`vllm:kv_cache_usage_perc` back to 0 within seconds, and the abort counted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from .conftest import DEMO, ENGINE_TOKEN, EngineProcess, RunningGateway, metric

LONG_PROMPT = "def add(a, b):\n    return a + b\n\n" * 60  # several hundred tokens: prefill takes many steps
ABORTED = 'finished_reason="abort"'


def body(phase: str, attempt: int) -> dict[str, Any]:
    # Each attempt starts differently, so no cached prefix shortens the next one's prefill.
    if phase == "before_headers":
        return {"model": DEMO, "prompt": f"x{attempt}", "max_tokens": 900, "ignore_eos": True}
    prompt = f"# {attempt}\n" + (LONG_PROMPT if phase == "prefill" else "def f(x):")
    return {"model": DEMO, "prompt": prompt, "max_tokens": 100 if phase == "prefill" else 900,
            "ignore_eos": True, "stream": True}


class Caller:
    """Sends one request and counts the stream's events, so a test knows which phase it is in."""

    def __init__(self, client: httpx.AsyncClient, payload: dict[str, Any]) -> None:
        self.client, self.payload = client, payload
        self.headers_seen = False
        self.events = 0

    async def run(self) -> None:
        async with self.client.stream("POST", "/v1/completions", json=self.payload) as response:
            self.headers_seen = True
            async for chunk in response.aiter_text():
                self.events += chunk.count("\n\n")


async def in_phase(engine: EngineProcess, caller: Caller, phase: str) -> bool:
    """True once the request is where the phase says (seen from the engine and the client)."""
    running = metric(await asyncio.to_thread(engine.metrics), "vllm:num_requests_running") > 0
    if phase == "before_headers":
        return running and not caller.headers_seen
    if phase == "prefill":
        return running and caller.events == 0
    return caller.events >= 3


async def hang_up_in(engine: EngineProcess, caller: Caller, phase: str) -> bool:
    """Hang up once the request is in `phase`; False if it got past the phase unseen."""
    task = asyncio.create_task(caller.run())
    deadline, caught = time.monotonic() + 30, False
    while not task.done() and time.monotonic() < deadline:
        if await in_phase(engine, caller, phase):
            caught = True
            break
        await asyncio.sleep(0.005)
    task.cancel()  # closes the connection, as a client that hangs up
    await asyncio.gather(task, return_exceptions=True)
    # The first token may have come between the last look and the hang-up.
    return caught and not (phase == "prefill" and caller.events)


async def disconnect_in(engine: EngineProcess, client: httpx.AsyncClient, phase: str) -> float:
    """Hang up in `phase`; return the engine's abort count from just before that request.

    On a busy machine a short phase can pass between two looks at the engine; then the
    request is dropped (and cleaned up) and a fresh one tried, up to three times."""
    for attempt in range(3):
        await asyncio.to_thread(engine.wait_idle, 10)
        aborted = metric(await asyncio.to_thread(engine.metrics), "vllm:request_success_total", ABORTED)
        if await hang_up_in(engine, Caller(client, body(phase, attempt)), phase):
            return aborted
    pytest.fail(f"three requests in a row got past the {phase} phase before the test could hang up")


PHASES = ["before_headers", "prefill", "mid_stream"]


@pytest.mark.parametrize("phase", PHASES)
async def test_disconnect_from_the_engine_frees_its_blocks(engine: EngineProcess, phase: str):
    transport = httpx.AsyncHTTPTransport(uds=str(engine.sock))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60,
                                 headers={"authorization": f"Bearer {ENGINE_TOKEN}"}) as client:
        aborted = await disconnect_in(engine, client, phase)
    await asyncio.to_thread(engine.wait_idle, 5)
    assert metric(engine.metrics(), "vllm:request_success_total", ABORTED) == aborted + 1


@pytest.mark.parametrize("phase", PHASES)
async def test_disconnect_through_the_gateway_frees_its_blocks(engine: EngineProcess, gw_engine: RunningGateway,
                                                               phase: str):
    async with gw_engine.client(headers=gw_engine.auth()) as client:
        aborted = await disconnect_in(engine, client, phase)
    await asyncio.to_thread(engine.wait_idle, 5)
    assert metric(engine.metrics(), "vllm:request_success_total", ABORTED) == aborted + 1
    record = (await gw_engine.wait_audit(1))[-1]
    assert (record["status"], record["reason"]) == (499, "client_disconnected")
    # The engine is fine afterwards: the next request is served in full.
    async with gw_engine.client(headers=gw_engine.auth()) as client:
        done = await client.post("/v1/completions", json={"model": DEMO, "prompt": "x", "max_tokens": 3})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1
