"""Anthropic's Messages API through the gateway: `x-api-key`, the allowlist, caps and limits
reserved before work, prompts counted by the engine's count_tokens, usage read from the
message and from its events for the audit line and budgets, and every refusal in Anthropic's
error envelope. Clients are httpx with the Anthropic SDK's headers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.sse import named_events as events

from .conftest import base_policy

MESSAGES_ROUTES = [{"method": "POST", "path": "/v1/messages"},
                   {"method": "POST", "path": "/v1/messages/count_tokens"}]


def messages_policy(**defaults: Any) -> dict[str, Any]:
    policy = base_policy()
    policy["routes"] = [*policy["routes"], *MESSAGES_ROUTES]
    policy["defaults"].update(defaults)
    return policy


def sdk_headers(key: str) -> dict[str, str]:
    """What the Anthropic SDK sends with `base_url` pointed at the gateway."""
    return {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}


def message(text: str = "Hello there", max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"model": "demo", "max_tokens": max_tokens, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}], **fields}




def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body) == {"type", "error"}
    return body["error"]["message"]


@pytest.fixture
def mgw(gateways):
    return gateways.start(messages_policy())


async def test_message_with_x_api_key_is_served_and_audited(mgw, stub):
    async with mgw.client() as client:
        response, record = await mgw.call(client, "POST", "/v1/messages", json=message(),
                                          headers=sdk_headers(mgw.keys["alice"]))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["type"] == "message" and answer["content"][0]["type"] == "text"
    forwarded = stub.requests[-1]
    assert forwarded["path"] == "/v1/messages" and "x-api-key" not in forwarded["headers"]
    assert forwarded["body"]["max_tokens"] == 8 and forwarded["body"]["cache_salt"]  # the tenant's salt
    assert record["route"] == "/v1/messages" and record["principal"] == "alice" and record["status"] == 200
    assert record["prompt_tokens"] == answer["usage"]["input_tokens"] > 0
    assert record["completion_tokens"] == answer["usage"]["output_tokens"] == 8
    assert record["cached_tokens"] == 0 and not record["tokens_estimated"]
    assert record["prompt_hmac"] and "Hello there" not in mgw.audit_text()


async def test_streamed_message_is_relayed_unchanged_and_audited(mgw, stub):
    body = message(max_tokens=5, stream=True, stub_tool_calls=2)
    async with mgw.client() as client:
        response, record = await mgw.call(client, "POST", "/v1/messages", json=body,
                                          headers=sdk_headers(mgw.keys["alice"]))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    seen = events(response.text)
    kinds = [kind for kind, _ in seen]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == 3
    assert all(data["type"] == kind for kind, data in seen)
    input_tokens = seen[0][1]["message"]["usage"]["input_tokens"]
    assert record["stream"] is True and record["status"] == 200 and record["reason"] == "ok"
    assert record["prompt_tokens"] == input_tokens > 0 and record["completion_tokens"] == 5
    assert not record["tokens_estimated"] and record["tool_calls"] == 2
    assert "stream_options" not in stub.requests[-1]["body"]  # Anthropic's stream carries its own usage


async def test_plain_message_tool_calls_are_counted(mgw):
    async with mgw.client() as client:
        _, record = await mgw.call(client, "POST", "/v1/messages", json=message(stub_tool_calls=3),
                                   headers=sdk_headers(mgw.keys["alice"]))
    assert record["tool_calls"] == 3


async def test_refusals_use_anthropic_error_envelope(mgw, stub):
    async with mgw.client() as client:
        missing = await client.post("/v1/messages", json=message(), headers={"anthropic-version": "2023-06-01"})
        wrong = await client.post("/v1/messages", json=message(), headers=sdk_headers("sk-ant-not-a-key-0123456789"))
        forbidden = await client.post("/v1/messages", json=message(model="other"),
                                      headers=sdk_headers(mgw.keys["bob"]))
        unlisted = await client.post("/v1/messages/batches", json=message(), headers=sdk_headers(mgw.keys["alice"]))
        no_max = {k: v for k, v in message().items() if k != "max_tokens"}
        required = await client.post("/v1/messages", json=no_max, headers=sdk_headers(mgw.keys["alice"]))
        fan_out = await client.post("/v1/messages", json=message(n=4), headers=sdk_headers(mgw.keys["alice"]))
        over_cap = await client.post("/v1/messages", json=message(max_tokens=100_000),
                                     headers=sdk_headers(mgw.keys["alice"]))
        chat = await client.post("/v1/chat/completions", json={"model": "demo", "messages": []})
    assert_anthropic_error(missing, 401, "authentication_error")
    assert_anthropic_error(wrong, 401, "authentication_error")
    assert "other" in assert_anthropic_error(forbidden, 403, "permission_error")
    assert assert_anthropic_error(unlisted, 404, "not_found_error") == "Not found."
    assert "max_tokens" in assert_anthropic_error(required, 400, "invalid_request_error")
    assert "'n'" in assert_anthropic_error(fan_out, 400, "invalid_request_error")
    assert "defaults.max_tokens" in assert_anthropic_error(over_cap, 400, "invalid_request_error")
    assert chat.status_code == 401 and "type" not in chat.json()  # OpenAI's routes keep OpenAI's envelope
    assert not stub.requests  # nothing refused reached the engine
    records = await mgw.wait_audit(8)
    assert len(records) == 8 and {r["decision"] for r in records} == {"denied"}
    mgw.assert_no_secrets({"x-api-key": "sk-ant-not-a-key-0123456789"})


async def test_failed_x_api_key_attempts_are_throttled(gateways):
    policy = messages_policy()
    policy["rate_limits"] = {"auth_failures_per_minute": 2}
    gw = gateways.start(policy)
    async with gw.client() as client:
        failed = [await client.post("/v1/messages", json=message(), headers=sdk_headers("x" * 32)) for _ in range(2)]
        throttled = await client.post("/v1/messages", json=message(), headers=sdk_headers("x" * 32))
        good = await client.post("/v1/messages", json=message(), headers=sdk_headers(gw.keys["alice"]))
    assert [r.status_code for r in failed] == [401, 401] and good.status_code == 200
    assert "failed authentication" in assert_anthropic_error(throttled, 429, "rate_limit_error")
    assert int(throttled.headers["retry-after"]) >= 1


async def test_tokens_per_minute_reserves_max_tokens_before_work(gateways, stub):
    gw = gateways.start(messages_policy(max_tokens=4096, tokens_per_minute=1000))
    async with gw.client() as client:
        first = await client.post("/v1/messages", json=message(max_tokens=700), headers=sdk_headers(gw.keys["alice"]))
        second = await client.post("/v1/messages", json=message(max_tokens=700), headers=sdk_headers(gw.keys["alice"]))
        too_big = await client.post("/v1/messages", json=message(max_tokens=2000), headers=sdk_headers(gw.keys["alice2"]))
    assert first.status_code == 200
    message_429 = assert_anthropic_error(second, 429, "rate_limit_error")
    assert int(second.headers["retry-after"]) >= 1 and "tokens_per_minute" in message_429
    assert "tokens_per_minute" in assert_anthropic_error(too_big, 429, "rate_limit_error")
    assert len([r for r in stub.requests if r["path"] == "/v1/messages"]) == 1  # refused before any work
    records = await gw.wait_audit(3)
    assert sorted(r["reason"] for r in records)[:1] == ["ok"]


async def test_prompt_cap_is_counted_by_count_tokens(gateways, stub):
    gw = gateways.start(messages_policy(max_prompt_tokens=40))
    tool = {"name": "lookup", "description": "Look a word up.", "input_schema": {"type": "object"}}
    async with gw.client() as client:
        short = await client.post("/v1/messages", json=message("hi", tools=[tool]),
                                  headers=sdk_headers(gw.keys["alice"]))
        long = await client.post("/v1/messages", json=message("word " * 60), headers=sdk_headers(gw.keys["alice"]))
    assert short.status_code == 200, short.text
    counted = [r for r in stub.requests if r["path"] == "/v1/messages/count_tokens"]
    assert len(counted) == 2
    assert counted[0]["body"]["tools"] == [tool] and counted[0]["body"]["system"] == "Be brief."
    assert "max_tokens" not in counted[0]["body"] and "stream" not in counted[0]["body"]
    text = assert_anthropic_error(long, 400, "invalid_request_error")
    assert "limit here is 40" in text
    assert [r["path"] for r in stub.requests].count("/v1/messages") == 1
    records = await gw.wait_audit(2)
    assert {r["reason"] for r in records} == {"ok", "prompt_too_long"}


async def test_count_tokens_route_is_charged_as_the_prompt_it_reads(gateways, stub):
    gw = gateways.start(messages_policy(max_prompt_tokens=10))  # a count is not held to the cap
    body = {k: v for k, v in message("word " * 30).items() if k != "max_tokens"}
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/messages/count_tokens", json=body,
                                         headers=sdk_headers(gw.keys["alice"]))
    assert response.status_code == 200
    assert record["prompt_tokens"] == response.json()["input_tokens"] > 10 and record["completion_tokens"] == 0
    assert [r["path"] for r in stub.requests] == ["/v1/messages/count_tokens"]


async def test_engine_failure_mid_stream_ends_with_an_anthropic_error_event(mgw):
    body = message(max_tokens=6, stream=True, stub_break_after=3)
    async with mgw.client() as client:
        response, record = await mgw.call(client, "POST", "/v1/messages", json=body,
                                          headers=sdk_headers(mgw.keys["alice"]))
    seen = events(response.text)
    assert seen[0][0] == "message_start" and "message_stop" not in [kind for kind, _ in seen]
    kind, data = seen[-1]
    assert kind == "error" and data["type"] == "error" and data["error"]["type"] in ("api_error", "overloaded_error")
    assert record["reason"] == "engine_stream_broken" and record["tokens_estimated"]
    assert record["prompt_tokens"] == seen[0][1]["message"]["usage"]["input_tokens"]  # known from message_start


async def test_messages_routes_are_404_where_the_policy_does_not_list_them(gw, stub):
    async with gw.client() as client:
        response = await client.post("/v1/messages", json=message(), headers=sdk_headers(gw.keys["alice"]))
    assert assert_anthropic_error(response, 404, "not_found_error") == "Not found."
    assert not stub.requests
