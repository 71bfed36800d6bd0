"""Anthropic's Messages API on the engine (issue 30): requests as Claude Code and the Anthropic
SDK send them, answers and stream events in Anthropic's shapes, errors in its envelope. What the
model writes is steered with `guided_regex` where a test needs a given reply (random weights)."""
from __future__ import annotations

import json
import re

import pytest

MODEL_NAME = "tiny-llama"
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def engine(agent_server):
    return agent_server


@pytest.fixture
def http(engine):
    with engine.http() as c:
        yield c


def _events(response) -> list[tuple[str, dict]]:
    out, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == kind
            out.append((kind, data))
    return out


def test_a_plain_message_in_anthropics_shape(http):
    body = {"model": MODEL_NAME, "max_tokens": 12, "system": [{"type": "text", "text": "Be brief."}],
            "messages": HELLO, "extra_body_ignored": None}
    r = http.post("/v1/messages", json={**body, "guided_regex": "Hello there\\."})
    assert r.status_code == 200, r.text
    message = r.json()
    assert (message["type"], message["role"], message["model"]) == ("message", "assistant", MODEL_NAME)
    assert message["id"].startswith("msg_")
    assert message["content"] == [{"type": "text", "text": "Hello there."}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["usage"]["input_tokens"] > 5 and message["usage"]["output_tokens"] >= 3
    r = http.post("/v1/messages", json={**body, "max_tokens": 3})
    assert r.json()["stop_reason"] == "max_tokens" and r.json()["usage"]["output_tokens"] == 3


def test_a_stop_sequence_is_named(http):
    r = http.post("/v1/messages", json={"model": MODEL_NAME, "max_tokens": 20, "messages": HELLO,
                                         "stop_sequences": ["there"], "guided_regex": "Hello there, friend\\."})
    message = r.json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "there")
    assert message["content"] == [{"type": "text", "text": "Hello "}]


def test_a_streamed_message_is_anthropics_event_sequence(http):
    body = {"model": MODEL_NAME, "max_tokens": 12, "messages": HELLO, "stream": True,
            "guided_regex": "Hello there\\."}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] > 5 and start["usage"]["output_tokens"] == 0
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert text == "Hello there."
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None} and delta["usage"]["output_tokens"] >= 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(http, stream):
    """A call (as a trained model writes it in the generic format), then its result sent back as a
    tool_result block, as Claude Code does."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    body = {"model": MODEL_NAME, "max_tokens": 40, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "guided_regex": re.escape(call), "stream": stream}
    if stream:
        with http.stream("POST", "/v1/messages", json=body) as r:
            events = _events(r)
        [start] = [d for k, d in events if k == "content_block_start"]
        block = start["content_block"]
        assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
        partial = "".join(d["delta"]["partial_json"] for k, d in events if k == "content_block_delta")
        use = {**block, "input": json.loads(partial)}
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    else:
        message = http.post("/v1/messages", json=body).json()
        assert message["stop_reason"] == "tool_use"
        [use] = message["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    follow = {"model": MODEL_NAME, "max_tokens": 8, "tools": [WEATHER], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                      "content": [{"type": "text", "text": "18 degrees"}]}]}]}
    r = http.post("/v1/messages", json=follow)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 20


def test_forced_tool_choice_follows_the_schema(http):
    r = http.post("/v1/messages", json={"model": MODEL_NAME, "max_tokens": 60, "messages": HELLO, "tools": [WEATHER],
                                         "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 1.0})
    message = r.json()
    assert message["stop_reason"] == "tool_use", message
    assert [b["type"] for b in message["content"]] == ["tool_use"]
    assert message["content"][0]["input"]["city"] in ("Paris", "Oslo")


def test_count_tokens_matches_what_a_message_is_charged(http):
    body = {"model": MODEL_NAME, "messages": HELLO, "system": "Be brief.", "tools": [WEATHER]}
    counted = http.post("/v1/messages/count_tokens", json={**body, "max_tokens": 99}).json()["input_tokens"]
    message = http.post("/v1/messages", json={**body, "max_tokens": 2}).json()
    assert counted == message["usage"]["input_tokens"] > 20


@pytest.mark.parametrize("body, says", [
    ({"model": MODEL_NAME, "messages": HELLO}, "max_tokens"),  # required, as Anthropic's API has it
    ({"model": MODEL_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"model": MODEL_NAME, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"model": "nope", "max_tokens": 5, "messages": HELLO}, "nope"),
    ({"model": MODEL_NAME, "max_tokens": 5, "messages": HELLO, "n": 2}, "one reply"),
])
def test_errors_are_in_anthropics_envelope(http, body, says):
    r = http.post("/v1/messages", json=body)
    assert r.status_code in (400, 404)
    error = r.json()
    assert error["type"] == "error" and says in error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")
    assert http.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO}).json()["error"]["type"] == \
        "not_found_error"  # the OpenAI routes keep OpenAI's envelope
