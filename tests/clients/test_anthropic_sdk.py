"""The Anthropic Python SDK against `portcullis serve`'s `/v1/messages`, configured as Claude Code
is (the gateway as base URL, the printed key sent as `x-api-key`): create, stream, a tool_use
round trip, and errors raised as the SDK's own exception classes."""
from __future__ import annotations

import re

import anthropic
import pytest

from .conftest import MODEL

HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture
def client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served["base"], api_key=served["key"])


def test_create(client):
    message = client.messages.create(model=MODEL, max_tokens=16, system="Be brief.", messages=HELLO,
                                     extra_body={"guided_regex": "Hello there\\."})
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there.")]
    assert message.stop_reason == "end_turn" and message.role == "assistant" and message.model == MODEL
    assert message.usage.input_tokens > 5 and message.usage.output_tokens >= 3


def test_stream_text_and_final_message(client):
    with client.messages.stream(model=MODEL, max_tokens=16, messages=HELLO,
                                extra_body={"guided_regex": "Hello there\\."}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there." and final.content[0].text == text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens >= 3


def test_a_tool_use_round_trip(client):
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    first = client.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"}], extra_body={"guided_regex": re.escape(call)})
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Oslo"} and use.id
    second = client.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], extra_body={"guided_regex": "Cold\\."},
                                    messages=[{"role": "user", "content": "Weather in Oslo?"},
                                              {"role": "assistant", "content": first.content},
                                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                            "content": "3 degrees"}]}])
    assert second.content[0].text == "Cold." and second.stop_reason == "end_turn"
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result were in the prompt


def test_errors_are_the_sdks_exception_classes(client, served):
    with pytest.raises(anthropic.NotFoundError, match="nope"):
        client.messages.create(model="nope", max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=served["base"], api_key="ptc_wrong.key").messages.create(
            model=MODEL, max_tokens=4, messages=HELLO)
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[])
