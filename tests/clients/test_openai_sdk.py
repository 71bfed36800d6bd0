"""The OpenAI Python SDK against `portcullis serve`: chat, streaming, a nested pydantic tool forced
and parsed back, `.parse()` with a nested response model, an agent's `tool_choice="auto"`, and the
Responses API with a function-call round trip. Replies are steered with `guided_regex` where a test
needs given content (random weights); schema-constrained replies are checked against the schema."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from .conftest import MODEL

ASK = [{"role": "user", "content": "Ship one order to Paris."}]


class Address(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    floor: int = pydantic.Field(ge=0, le=9)


class Order(pydantic.BaseModel):
    """Ship an order."""
    to: Address
    express: bool
    stops: list[Address] = pydantic.Field(max_length=2)


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key=served["key"])


def test_chat_counts_its_usage(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16,
                                         extra_body={"guided_regex": "On its way\\."})
    assert out.choices[0].message.content == "On its way." and out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 5 and out.usage.completion_tokens >= 3
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_chat_is_the_same_text_with_usage_last(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"guided_regex": "On its way\\."}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "On its way."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 3


def test_a_forced_pydantic_function_tool_with_nested_models_parses_back(client):
    tool = openai.pydantic_function_tool(Order)
    assert "$defs" in tool["function"]["parameters"]  # the shape that used to be a 400
    for seed in range(3):
        out = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool], max_tokens=200, seed=seed,
                                            temperature=1.0, tool_choice={"type": "function", "function": {"name": "Order"}})
        [call] = out.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, Order)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert out.usage.completion_tokens > 0


def test_parse_with_a_nested_response_model(client):
    for seed in range(3):
        out = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Order, max_tokens=200,
                                            seed=seed, temperature=1.0)
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(out.choices[0].message.parsed, Order)


def test_an_agents_auto_tool_choice_calls_the_tool_or_answers(client):
    tool = openai.pydantic_function_tool(Address, name="weather_at")
    call = '{"name": "weather_at", "arguments": {"city": "Oslo", "floor": 0}}'
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], tool_choice="auto", max_tokens=80,
                                         extra_body={"guided_regex": re.escape(call)})  # as a trained model writes it
    assert out.choices[0].finish_reason == "tool_calls"
    [made] = out.choices[0].message.tool_calls
    assert made.function.name == "weather_at" and Address.model_validate_json(made.function.arguments).city == "Oslo"
    # Tools on offer do not force a call: a plain answer stays a plain answer.
    text = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], max_tokens=16,
                                          extra_body={"guided_regex": "Sunny\\."})
    assert text.choices[0].message.content == "Sunny." and not text.choices[0].message.tool_calls


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}


def test_responses_streamed_with_a_function_call_round_trip(client):
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=40,
                                          stream=True, extra_body={"guided_regex": re.escape(call)}))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Oslo"}
    first = events[-1].response
    [made] = first.output
    assert made.type == "function_call" and made.name == "get_weather"
    follow = client.responses.stream  # the SDK's helper accumulates the events into the final response
    with follow(model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=16,
                input=[{"type": "function_call_output", "call_id": made.call_id, "output": "3 degrees"}],
                extra_body={"guided_regex": "Cold\\."}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == "Cold." and final.previous_response_id == first.id
    assert final.usage.input_tokens > first.usage.input_tokens  # the first turn and its call were carried over
