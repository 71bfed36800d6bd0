"""The proxy: streaming chunk by chunk, usage chunk handling, client disconnects closing
the upstream stream, engine failures, and the probes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

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
    from .test_upstream_transport import RawServer

    broken = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"id"'
    async with RawServer(str(tmp_path / "raw.sock"), [broken], close_after_each=True) as server:
        gw = gateways.start(engine_url=f"unix://{server.path}")
        async with gw.client() as client:
            response, record = await gw.call(client, "POST", "/v1/completions",
                                             json={"model": "demo", "prompt": "hi"}, headers=gw.auth())
    assert response.status_code == 502 and response.json()["error"]["code"] == "engine_error"
    assert record["decision"] == "failed" and record["reason"] == "engine_error"


# ---- what a request is charged when the engine's count never comes (findings 4, 5, 17) -------

def _reply(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _limited_policy():
    from .conftest import base_policy

    policy = base_policy()
    policy["tenants"]["acme"]["limits"] = {"tokens_per_minute": 1000, "max_n": 64}
    if time.time() % 60 > 50:  # the sliding window weighs the minute before: keep each test to one minute
        time.sleep(60.5 - time.time() % 60)
    return policy


async def _tokens_left(gw) -> int:
    return 1000 - await gw.gateway.limiter.tokens_used("tenant:acme")


async def test_a_reply_without_usage_is_charged_its_reservation(gateways, tmp_path):
    from .test_upstream_transport import RawServer

    body = {"model": "demo", "prompt": "x" * 40, "n": 4, "max_tokens": 50}  # 10 + 4 x 50 tokens
    async with RawServer(str(tmp_path / "raw.sock"), [_reply(b'{"id":"x","choices":[]}')]) as server:
        gw = gateways.start(_limited_policy(), engine_url=f"unix://{server.path}")
        async with gw.client() as client:
            response, record = await gw.call(client, "POST", "/v1/completions", json=body, headers=gw.auth())
        assert response.status_code == 200
        assert record["tokens_estimated"] is True
        assert (record["prompt_tokens"], record["completion_tokens"]) == (10, 200)
        assert await _tokens_left(gw) == 1000 - 210


async def test_a_non_streamed_request_the_client_abandons_is_charged(gateways, tmp_path):
    from .test_upstream_transport import RawServer

    body = {"model": "demo", "prompt": "hi", "n": 8, "max_tokens": 100}
    async with RawServer(str(tmp_path / "raw.sock"), []) as server:  # never answers
        gw = gateways.start(_limited_policy(), engine_url=f"unix://{server.path}")
        async with httpx.AsyncClient(base_url=gw.url, timeout=0.5) as client:
            try:
                await client.post("/v1/completions", json=body, headers=gw.auth())
            except httpx.TimeoutException:
                pass
        records = await gw.wait_audit(1)
        assert records[-1]["status"] == 499 and records[-1]["tokens_estimated"] is True
        assert records[-1]["completion_tokens"] == 800
        assert await _tokens_left(gw) == 1000 - 800
        async with gw.client() as client:  # 800 gone: 300 more cannot fit this minute
            response, record = await gw.call(client, "POST", "/v1/completions",
                                             json={**body, "n": 3}, headers=gw.auth())
        assert response.status_code == 429 and record["reason"] == "token_rate_limit"


async def test_a_response_over_max_response_bytes_is_not_buffered_whole(gateways, tmp_path):
    from .test_upstream_transport import RawServer

    policy = _limited_policy()
    policy["tenants"]["acme"]["limits"]["max_response_bytes"] = 4096
    huge = b'{"choices":[{"text":"' + b"x" * 10_000 + b'"}]}'
    async with RawServer(str(tmp_path / "raw.sock"), [_reply(huge)]) as server:
        gw = gateways.start(policy, engine_url=f"unix://{server.path}")
        async with gw.client() as client:
            response, record = await gw.call(client, "POST", "/v1/completions",
                                             json={"model": "demo", "prompt": "hi", "max_tokens": 20},
                                             headers=gw.auth())
    assert response.status_code == 400 and record["reason"] == "response_too_large"
    error = response.json()["error"]
    assert error["code"] == "response_too_large" and "max_response_bytes" in error["message"]
    assert record["tokens_estimated"] is True  # the engine did the work: it is charged


async def test_gateway_metrics_show_a_refused_policy_reload(gw):
    """A refused edit keeps the old policy serving: operators see it in the metrics they scrape."""
    async with gw.client() as client:
        before, _ = await gw.call(client, "GET", "/gateway/metrics", headers=gw.auth("root"))
        assert "portcullis_gateway_policy_reload_refused 0.0" in before.text
        gw.policy_path.write_text("routes: [not, a, policy\n")
        assert not gw.gateway.store.reload()
        after, _ = await gw.call(client, "GET", "/gateway/metrics", headers=gw.auth("root"))
    assert "portcullis_gateway_policy_reload_refused 1.0" in after.text
    assert "portcullis_gateway_policy_generation 0.0" in after.text
