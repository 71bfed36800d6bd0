"""OpenAI's Responses API through the gateway: the allowlist, caps and limits reserved before
work (`max_output_tokens`, or the context an open-ended reply may fill), prompts counted by the
engine's /tokenize as the chat conversation the engine runs, usage read from the Response and
from its `response.completed` / `response.incomplete` event for the audit line and budgets, a
broken stream ended by an `error` event, refusals in OpenAI's envelope."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from portcullis.gateway.body import UNKNOWN_CONTEXT_MAX_TOKENS
from tests.support.sse import named_events as events

from .conftest import base_policy

RESPONSES_ROUTE = {"method": "POST", "path": "/v1/responses"}


def responses_policy(**defaults: Any) -> dict[str, Any]:
    policy = base_policy()
    policy["routes"] = [*policy["routes"], RESPONSES_ROUTE]
    policy["defaults"].update(defaults)
    return policy


def uncapped_policy(**defaults: Any) -> dict[str, Any]:
    policy = responses_policy(**defaults)
    del policy["defaults"]["max_tokens"]
    return policy


def request(text: str = "Hello there", max_output_tokens: int | None = 8, **fields: Any) -> dict[str, Any]:
    """What the OpenAI SDK's `responses.create` sends: instructions, and input items."""
    body = {"model": "demo", "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}], **fields}
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    return body




def assert_openai_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and set(response.json()) == {"error"}
    return error["message"]


@pytest.fixture
def rgw(gateways):
    return gateways.start(responses_policy())


async def test_response_is_served_and_audited_with_its_tokens(rgw, stub):
    async with rgw.client() as client:
        response, record = await rgw.call(client, "POST", "/v1/responses", json=request(stub_tool_calls=2),
                                          headers=rgw.auth("alice"))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "response" and answer["output"][0]["type"] == "message"
    forwarded = stub.requests[-1]
    assert forwarded["path"] == "/v1/responses" and forwarded["body"]["max_output_tokens"] == 8
    assert forwarded["body"]["cache_salt"] and "max_tokens" not in forwarded["body"]  # the tenant's salt
    assert record["route"] == "/v1/responses" and record["principal"] == "alice" and record["status"] == 200
    assert record["prompt_tokens"] == answer["usage"]["input_tokens"] > 0
    assert record["completion_tokens"] == answer["usage"]["output_tokens"] == 8
    assert record["cached_tokens"] == 0 and not record["tokens_estimated"] and record["tool_calls"] == 2
    assert record["prompt_hmac"] and "Hello there" not in rgw.audit_text()


@pytest.mark.parametrize(("calls", "last"), [(2, "response.completed"), (0, "response.incomplete")])
async def test_streamed_response_is_relayed_unchanged_and_audited(rgw, stub, calls, last):
    body = request(max_output_tokens=5, stream=True, stub_tool_calls=calls)
    async with rgw.client() as client:
        response, record = await rgw.call(client, "POST", "/v1/responses", json=body, headers=rgw.auth("alice"))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    seen = events(response.text)
    assert [kind for kind, _ in seen][:2] == ["response.created", "response.in_progress"] and seen[-1][0] == last
    assert all(data["type"] == kind for kind, data in seen)
    assert [data["sequence_number"] for _, data in seen] == list(range(len(seen)))
    usage = seen[-1][1]["response"]["usage"]
    assert record["stream"] is True and record["status"] == 200 and record["reason"] == "ok"
    assert record["prompt_tokens"] == usage["input_tokens"] > 0 and record["completion_tokens"] == 5
    assert not record["tokens_estimated"] and record.get("tool_calls", 0) == calls
    assert "stream_options" not in stub.requests[-1]["body"]  # the stream carries its own usage


async def test_tokens_per_minute_reserves_max_output_tokens_before_work(gateways, stub):
    gw = gateways.start(responses_policy(max_tokens=4096, tokens_per_minute=1000))
    async with gw.client() as client:
        first = await client.post("/v1/responses", json=request(max_output_tokens=700), headers=gw.auth("alice"))
        second = await client.post("/v1/responses", json=request(max_output_tokens=700), headers=gw.auth("alice"))
        too_big = await client.post("/v1/responses", json=request(max_output_tokens=2000), headers=gw.auth("alice2"))
    assert first.status_code == 200
    assert "tokens_per_minute" in assert_openai_error(second, 429, "token_rate_limit")
    assert int(second.headers["retry-after"]) >= 1
    assert "tokens_per_minute" in assert_openai_error(too_big, 429, "token_rate_limit")
    assert len([r for r in stub.requests if r["path"] == "/v1/responses"]) == 1  # refused before any work


async def test_max_output_tokens_is_held_to_the_policy_cap(gateways, stub):
    gw = gateways.start(responses_policy(max_tokens=64))
    async with gw.client() as client:
        over = await client.post("/v1/responses", json=request(max_output_tokens=100), headers=gw.auth("alice"))
        absent = await client.post("/v1/responses", json=request(max_output_tokens=None), headers=gw.auth("alice"))
    assert "defaults.max_tokens" in assert_openai_error(over, 400, "max_tokens_over_cap")
    assert absent.status_code == 200 and stub.requests[-1]["body"]["max_output_tokens"] == 64


async def test_an_open_ended_response_reserves_the_context_it_may_fill(gateways, stub):
    gw = gateways.start(uncapped_policy(tokens_per_minute=10000))
    async with gw.client() as client:
        response = await client.post("/v1/responses", json=request(max_output_tokens=None), headers=gw.auth("alice"))
    assert response.status_code == 200 and response.headers["x-ratelimit-remaining-tokens"] == str(10000 - 4096)
    assert "max_output_tokens" not in stub.requests[-1]["body"]  # sent as it came: the reserve covers it


async def test_an_open_ended_response_is_capped_where_the_context_is_unknown(gateways, stub, monkeypatch):
    monkeypatch.setattr(stub, "max_model_len", None)
    gw = gateways.start(uncapped_policy(tokens_per_minute=1000))
    async with gw.client() as client:
        response = await client.post("/v1/responses", json=request(max_output_tokens=None), headers=gw.auth("alice"))
    assert response.status_code == 200
    forwarded = stub.requests[-1]["body"]
    assert forwarded["max_output_tokens"] == UNKNOWN_CONTEXT_MAX_TOKENS and "max_tokens" not in forwarded
    remaining = int(response.headers["x-ratelimit-remaining-tokens"])
    assert 1000 - UNKNOWN_CONTEXT_MAX_TOKENS - 32 <= remaining < 1000 - UNKNOWN_CONTEXT_MAX_TOKENS  # and the prompt


async def test_refusals_use_openai_envelope_and_reach_no_engine(rgw, stub):
    async with rgw.client() as client:
        post = lambda body, who="alice": client.post("/v1/responses", json=body, headers=rgw.auth(who))  # noqa: E731
        forbidden = await post(request(model="other"), "bob")
        chat_length = await post(request(max_tokens=100_000))
        fan_out = await post(request(n=2))
        no_input = await post({"model": "demo", "max_output_tokens": 8})
        bad_input = await post({**request(), "input": [1, 2]})
        bad_length = await post(request(max_output_tokens="8"))
    assert "other" in assert_openai_error(forbidden, 403, "model_not_allowed")
    assert "max_output_tokens" in assert_openai_error(chat_length, 400, "malformed_request")
    assert "'n'" in assert_openai_error(fan_out, 400, "malformed_request")
    assert "'input' is required" in assert_openai_error(no_input, 400, "malformed_request")
    assert "'input'" in assert_openai_error(bad_input, 400, "malformed_request")
    assert "positive integer" in assert_openai_error(bad_length, 400, "malformed_request")
    assert not stub.requests
    records = await rgw.wait_audit(6)
    assert len(records) == 6 and {r["decision"] for r in records} == {"denied"}
    assert {r["route"] for r in records} == {"/v1/responses"}


async def test_prompt_cap_is_counted_as_the_chat_conversation_the_engine_runs(gateways, stub):
    gw = gateways.start(responses_policy(max_prompt_tokens=60))
    tool = {"type": "function", "name": "lookup", "description": "Look a word up.",
            "parameters": {"type": "object"}, "strict": False}
    turns = [{"role": "developer", "content": "Use tools."}, request("hi")["input"][0],
             {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "found"}]
    async with gw.client() as client:
        short = await client.post("/v1/responses", json=request(input=turns, tools=[tool]), headers=gw.auth("alice"))
        long = await client.post("/v1/responses", json=request("word " * 80), headers=gw.auth("alice"))
    assert short.status_code == 200, short.text
    counted = [r["body"] for r in stub.requests if r["path"] == "/tokenize"]
    assert len(counted) == 2
    assert counted[0]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"}]
    assert counted[0]["tools"] == [{"type": "function", "function": {
        "name": "lookup", "description": "Look a word up.", "parameters": {"type": "object"}}}]
    assert "limit here is 60" in assert_openai_error(long, 400, "prompt_too_long")
    assert [r["path"] for r in stub.requests].count("/v1/responses") == 1


async def test_engine_failure_mid_stream_ends_with_an_error_event(rgw):
    body = request(max_output_tokens=6, stream=True, stub_break_after=3)
    async with rgw.client() as client:
        response, record = await rgw.call(client, "POST", "/v1/responses", json=body, headers=rgw.auth("alice"))
    seen = events(response.text)
    kinds = [kind for kind, _ in seen]
    assert kinds[0] == "response.created" and "response.completed" not in kinds
    kind, data = seen[-1]
    assert kind == "error" and data["type"] == "error" and data["code"] == "engine_stream_broken"
    assert data["sequence_number"] == seen[-2][1]["sequence_number"] + 1 and "incomplete" in data["message"]
    assert record["reason"] == "engine_stream_broken" and record["tokens_estimated"]


async def test_responses_route_is_404_where_the_policy_does_not_list_it(gateways, gw, stub):
    async with gw.client() as client:
        response = await client.post("/v1/responses", json=request(), headers=gw.auth("alice"))
    assert assert_openai_error(response, 404, "route_not_allowed") == "Not found."
    assert not stub.requests
    listed = gateways.start(responses_policy(), name="listed")  # the same request, where it is listed
    async with listed.client() as client:
        response, record = await listed.call(client, "POST", "/v1/responses", json=request(),
                                             headers=listed.auth("alice"))
    assert response.status_code == 200 and record["completion_tokens"] == 8


def test_relay_reads_usage_and_numbers_across_any_chunking():
    """Events split anywhere (the engine's writes are not the events' bounds) read the same."""
    from portcullis.gateway.upstream.sse import ResponsesSseRelay

    def event(number: int, kind: str, **data: Any) -> bytes:
        payload = json.dumps({"type": kind, **data, "sequence_number": number})
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}
    usage = {"input_tokens": 7, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 2}}
    stream = b"".join([event(0, "response.created", response={"usage": None}),
                       event(1, "response.output_text.delta", delta='"sequence_number": 99'),
                       event(2, "response.output_item.added", output_index=1, item=call),
                       event(3, "response.completed", response={"status": "completed", "usage": usage})])
    for size in (1, 7, 64, len(stream)):
        relay = ResponsesSseRelay()
        out = b"".join(relay.feed(stream[at:at + size]) for at in range(0, len(stream), size)) + relay.flush()
        assert out == stream and relay.tool_calls == 1
        assert relay.usage == {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
        broken = json.loads(relay.error_event(502, "gone", "engine_stream_broken", "/v1/responses").split(b"data: ")[1])
        assert broken == {"type": "error", "code": "engine_stream_broken", "message": "gone", "param": None,
                          "sequence_number": 4}


async def test_a_stored_response_is_read_back_by_those_who_may_create_them(gateways, stub):
    """`responses.retrieve` (GET /v1/responses/{id}): allowed where POST /v1/responses is, sent to
    the engine with the tenant's tag (the engine keeps tenants' responses apart), charged nothing;
    a path that is not a response id is the allowlist's 404."""
    rgw = gateways.start(responses_policy())
    async with rgw.client() as client:
        response, record = await rgw.call(client, "GET", "/v1/responses/resp_0123abc", headers=rgw.auth("alice"))
        assert response.status_code == 200, response.text
        assert response.json()["id"] == "resp_0123abc"
        seen = stub.requests[-1]
        assert seen["method"] == "GET" and seen["path"] == "/v1/responses/resp_0123abc"
        assert seen["headers"]["x-portcullis-tenant"]
        assert record["route"] == "/v1/responses/{id}" and record["status"] == 200
        assert not record.get("prompt_tokens") and not record.get("completion_tokens")
        for odd in ("/v1/responses/other_1", "/v1/responses/resp_1/cancel"):
            assert (await client.get(odd, headers=rgw.auth("alice"))).status_code == 404
    plain = gateways.start(base_policy(), name="plain")  # no /v1/responses route: no read-back either
    async with plain.client() as client:
        assert (await client.get("/v1/responses/resp_0123abc", headers=plain.auth("alice"))).status_code == 404
