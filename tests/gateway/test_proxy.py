"""The proxy: streaming chunk by chunk, usage chunk handling, client disconnects closing
the upstream stream, engine failures, and the probes."""

from __future__ import annotations

import asyncio
import json
import time

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


async def test_first_chunk_arrives_before_the_stub_finishes(gw, stub):
    stub.chunk_delay_s = 0.15  # 8 chunks: the whole stream takes about 1.2 s
    async with gw.client() as client:
        started = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=CHAT, headers=gw.auth()) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            chunks = response.aiter_raw()
            first = await chunks.__anext__()
            first_at = time.monotonic() - started
            assert b"tok0" in first and stub.streams_finished == 0
            rest = b"".join([chunk async for chunk in chunks])
        total = time.monotonic() - started
    assert total - first_at > 0.5  # the rest kept coming long after the first chunk
    records = await gw.wait_audit(1)
    assert records[-1]["status"] == 200
    assert records[-1]["ttfb_ms"] < records[-1]["latency_ms"] - 500
    assert records[-1]["completion_tokens"] == 8 and records[-1]["stream"] is True
    assert (first + rest).endswith(b"data: [DONE]\n\n")


async def test_usage_chunk_is_stripped_unless_the_client_asked(gw, stub):
    async with gw.client() as client:
        plain, record = await gw.call(client, "POST", "/v1/chat/completions", json=CHAT, headers=gw.auth())
        asked, _ = await gw.call(client, "POST", "/v1/chat/completions",
                                 json={**CHAT, "stream_options": {"include_usage": True}}, headers=gw.auth())
    assert stub.requests[0]["body"]["stream_options"] == {"include_usage": True}
    plain_events = _events(plain.text)
    assert plain_events[-1] == "[DONE]" and all("usage" not in e for e in plain_events)
    usage = json.loads(_events(asked.text)[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] == 8  # counted anyway


async def test_client_disconnect_closes_the_upstream_stream(gw, stub):
    stub.chunk_delay_s = 0.05
    body = {**CHAT, "max_tokens": 200}  # 10 s if nobody stops it
    async with gw.client() as client:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=gw.auth()) as response:
            async for _ in response.aiter_raw():
                break  # read one chunk, then hang up
    deadline = time.monotonic() + 3
    while stub.streams_aborted == 0:
        assert time.monotonic() < deadline, "the engine never saw the disconnect"
        await asyncio.sleep(0.02)
    assert stub.streams_finished == 0
    records = await gw.wait_audit(1)
    assert len(records) == 1
    assert records[0]["status"] == 499 and records[0]["reason"] == "client_disconnected"
    assert records[0]["tokens_estimated"] is True
    assert gw.gateway.limiter.slots._held == {}  # no concurrency slot leaked


async def test_engine_down_is_503_and_audited(gateways, tmp_path):
    gw = gateways.start(engine_url=f"unix://{tmp_path}/nothing-here.sock")
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions",
                                         json={"model": "demo", "prompt": "hi"}, headers=gw.auth())
        ready = await client.get("/readyz")
        alive = await client.get("/healthz")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert record["decision"] == "failed" and record["reason"] == "engine_unavailable"
    assert ready.status_code == 503 and alive.status_code == 200


async def test_engine_overload_passes_through(gw, stub):
    stub.fail_status = 503
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions",
                                         json={"model": "demo", "prompt": "hi"}, headers=gw.auth())
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "overloaded"
    assert record["decision"] == "failed" and record["reason"] == "engine_status_503"


async def test_probes(gw):
    async with gw.client() as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.get("/readyz")).json() == {"status": "ready"}
    assert gw.audit_records() == []  # probes are not client traffic


async def test_gateway_metrics_need_the_admin_scope(gw):
    async with gw.client() as client:
        await gw.call(client, "POST", "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=gw.auth())
        denied, _ = await gw.call(client, "GET", "/gateway/metrics", headers=gw.auth("alice"))
        anonymous, _ = await gw.call(client, "GET", "/gateway/metrics")
        allowed, _ = await gw.call(client, "GET", "/gateway/metrics", headers=gw.auth("root"))
    assert denied.status_code == 404 and anonymous.status_code == 401
    assert allowed.status_code == 200
    text = allowed.text
    assert 'portcullis_gateway_requests_total{decision="denied",route="/v1/completions",status="403",tenant="acme"} 1.0' in text
    assert 'portcullis_gateway_auth_failures_total{reason="missing_credentials"} 1.0' in text


async def test_engine_breaking_off_a_response_is_502(gateways, tmp_path):
    from .test_engine_transport import RawServer

    broken = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"id"'
    async with RawServer(str(tmp_path / "raw.sock"), [broken], close_after_each=True) as server:
        gw = gateways.start(engine_url=f"unix://{server.path}")
        async with gw.client() as client:
            response, record = await gw.call(client, "POST", "/v1/completions",
                                             json={"model": "demo", "prompt": "hi"}, headers=gw.auth())
    assert response.status_code == 502 and response.json()["error"]["code"] == "engine_error"
    assert record["decision"] == "failed" and record["reason"] == "engine_error"
