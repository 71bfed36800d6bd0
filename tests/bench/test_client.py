"""The streaming client of `portcullis bench serve`: what counts as a failed request."""
from __future__ import annotations

import asyncio

import httpx

from portcullis.bench.client import RequestPlan, send
from portcullis.bench.datasets import SampleRequest

STREAM = b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\ndata: [DONE]\n\n'


def run(handler) -> tuple[object, int]:
    calls = []

    def counted(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return handler(len(calls))

    async def go():
        plan = RequestPlan(url="http://server/v1/completions", endpoint="/v1/completions", model="m",
                           headers={}, ignore_eos=True, extra_body={})
        async with httpx.AsyncClient(transport=httpx.MockTransport(counted)) as client:
            return await send(client, plan, SampleRequest(prompt="hello", prompt_len=1, expected_output_len=1), "r1")

    return asyncio.run(go()), len(calls)


def test_a_keep_alive_connection_the_server_had_closed_is_retried_once():
    """llama.cpp's server closes idle keep-alive connections; httpx then reports the next request
    on that connection as 'Server disconnected without sending a response'. Not a failed request."""

    def handler(n: int) -> httpx.Response:
        if n == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=STREAM, headers={"content-type": "text/event-stream"})

    result, calls = run(handler)
    assert calls == 2 and result.success and result.generated_text == "Hi" and not result.error


def test_a_server_that_keeps_disconnecting_fails_the_request_after_one_retry():
    def handler(n: int) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    result, calls = run(handler)
    assert calls == 2 and not result.success and "Server disconnected" in result.error


def test_a_refusal_is_not_retried():
    result, calls = run(lambda n: httpx.Response(429, json={"error": {"message": "slow down"}}))
    assert calls == 1 and not result.success and result.error.startswith("HTTP 429")
