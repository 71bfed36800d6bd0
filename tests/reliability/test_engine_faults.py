"""Engine faults, injected into real processes: the engine SIGKILLed mid-stream under
`portcullis serve`, and an engine that hangs (no bytes) behind the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import DEMO, EngineProcess, GatewayFactory, Served, metric, start_serve, wait_for

LONG_STREAM = {"model": DEMO, "prompt": "def fibonacci(n):", "max_tokens": 900, "ignore_eos": True,
               "stream": True, "temperature": 0}


def sse_events(text: str) -> list[str]:
    return [event.strip() for event in text.split("\n\n") if event.strip()]


def assert_openai_error(payload: dict) -> dict:
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    running = start_serve(tmp_path_factory.mktemp("serve-faults"))
    yield running
    running.stop()


def test_engine_killed_mid_stream_ends_the_stream_with_an_error_and_serve_recovers(served: Served):
    engines = served.children("-m portcullis.engine")
    assert len(engines) == 1
    with httpx.Client(base_url=served.base, headers=served.headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=LONG_STREAM) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            received, chunks = "", response.iter_text()
            while received.count("\n\n") < 5:  # a few tokens are out: the stream is under way
                received += next(chunks)
            os.kill(engines[0], signal.SIGKILL)
            received += "".join(chunks)  # the gateway must end the stream, not leave it hanging
    events = sse_events(received)
    assert events[-1].startswith("data: {"), events[-3:]
    error = assert_openai_error(json.loads(events[-1][len("data: "):]))
    assert error["code"] == "engine_stream_broken" and "data: [DONE]" not in events
    wait_for(lambda: any(r.get("request_id") == request_id for r in served.audit()), 10, "the audit line")
    record = next(r for r in served.audit() if r.get("request_id") == request_id)  # not start or admin lines
    assert (record["status"], record["decision"], record["reason"]) == (502, "failed", "engine_stream_broken")
    assert record["completion_tokens"] >= 5  # charged for what went out
    # serve restarts the engine; the next request succeeds (503 with Retry-After meanwhile).
    body = {"model": DEMO, "prompt": "x", "max_tokens": 3}
    def answered() -> bool:
        r = httpx.post(served.base + "/v1/completions", json=body, headers=served.headers, timeout=30)
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert_openai_error(r.json()) and r.headers["retry-after"]
        return r.status_code == 200
    wait_for(answered, 180, "the restarted engine to answer", every=0.5)
    assert served.children("-m portcullis.engine") != engines


# ---- a hung engine -----------------------------------------------------------------------

class HangingEngine:
    """A Unix-socket "engine" that reads each request and never answers (or, for streams,
    sends the head and one event, then nothing). It records when the gateway hangs up."""

    def __init__(self, sock: Path, stream_first: bool = False) -> None:
        self.sock, self.stream_first = sock, stream_first
        self.requests = 0
        self.closed_after: list[float] = []  # seconds from request to the gateway closing
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> HangingEngine:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(asyncio.start_unix_server(self._serve, str(self.sock)), self.loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the body may follow; we never read it
        self.requests += 1
        began = time.monotonic()
        if self.stream_first:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            event = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        while await reader.read(65536):  # no answer; wait for the other side to go away
            pass
        self.closed_after.append(time.monotonic() - began)
        writer.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_hung_engine_gets_504_and_the_gateway_hangs_up(gateways: GatewayFactory, tmp_path: Path, stream: bool):
    sock = Path(f"/tmp/ptc-hang-{os.getpid()}-{stream:d}.sock")  # short: Unix socket paths max out at 108
    sock.unlink(missing_ok=True)
    try:
        with HangingEngine(sock, stream_first=stream) as hung:
            gw = gateways.start(engine_url=f"unix://{sock}", engine_read_timeout_s=1.0)
            async with gw.client() as client:
                began = time.monotonic()
                response = await client.post("/v1/completions", headers=gw.auth(),
                                             json={"model": "demo", "prompt": "x", "max_tokens": 4, "stream": stream})
                waited = time.monotonic() - began
            assert waited < 5, f"the client waited {waited:.1f} s for a 1 s engine timeout"
            if stream:  # the head was already sent: the stream ends with an error event
                assert response.status_code == 200
                events = sse_events(response.text)
                assert events[0].startswith("data: {\"choices\"")
                error = assert_openai_error(json.loads(events[-1][len("data: "):]))
            else:
                assert response.status_code == 504
                error = assert_openai_error(response.json())
            assert error["code"] == "engine_timeout" and error["type"] == "upstream_timeout"
            record = (await gw.wait_audit(1))[-1]
            assert (record["status"], record["decision"], record["reason"]) == (504, "failed", "engine_timeout")
            # Closing the connection is what tells a real engine to abort and free the blocks.
            wait_for(lambda: len(hung.closed_after) == hung.requests == 1, 5, "the gateway to hang up")
            assert hung.closed_after[0] < 3
    finally:
        sock.unlink(missing_ok=True)


@contextlib.contextmanager
def frozen(engine: EngineProcess) -> Iterator[None]:
    os.kill(engine.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_frozen_engine_gets_504_and_aborts_the_request_when_it_wakes(
        gateways: GatewayFactory, engine: EngineProcess, stream: bool):
    """The real engine, frozen with SIGSTOP while it generates: the client gets 504 (or the
    error event) after the read timeout, and once the engine runs again it sees the closed
    connection, aborts the request and frees its blocks."""
    engine.wait_idle()
    aborted = metric(engine.metrics(), "vllm:request_success_total", 'finished_reason="abort"')
    gw = gateways.start(engine_url=f"unix://{engine.sock}", engine_read_timeout_s=2.0)
    body = {"model": "demo", "prompt": "x", "max_tokens": 250, "ignore_eos": True, "stream": stream}
    async with gw.client(headers=gw.auth()) as client:
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                chunks = response.aiter_text()
                received = await anext(chunks)  # the stream is under way
                with frozen(engine):
                    received += "".join([chunk async for chunk in chunks])
            error = assert_openai_error(json.loads(sse_events(received)[-1][len("data: "):]))
        else:
            sending = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_for, lambda: metric(engine.metrics(), "vllm:num_requests_running") == 1,
                                    10, "the engine to start the request")
            with frozen(engine):
                response = await sending
            assert response.status_code == 504
            error = assert_openai_error(response.json())
    assert error["code"] == "engine_timeout"
    await asyncio.to_thread(engine.wait_idle, 10)
    assert metric(engine.metrics(), "vllm:request_success_total", 'finished_reason="abort"') == aborted + 1
