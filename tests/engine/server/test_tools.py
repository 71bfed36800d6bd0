"""Tool calling in chat: forced calls always parse and follow the function's schema, `auto`
(with --enable-auto-tool-choice) turns a call in the reply into `tool_calls`, and bad tool
requests are a 400. Streaming and the formats in detail: test_tool_streaming.py and
test_tool_parsers.py."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from portcullis.engine.server.tools import AUTO_NEEDS_FLAGS, tool_plan

from .conftest import start_server

MODEL_NAME = "tiny-llama"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_tool_choice_forces_a_valid_call(client):
    for seed in range(4):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_calls_one_of_the_tools(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=60, temperature=1.0, seed=5)
    call = out.choices[0].message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_streamed_forced_call(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=60, stream=True, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    # One call, now streamed as several deltas: its name once, then its arguments in pieces.
    assert {d.index for d in deltas} == {0} and [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


@pytest.fixture(scope="module")
def auto_client(server_model, tmp_path_factory):
    running = start_server(server_model, tmp_path_factory.mktemp("auto-tools"),
                           tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield running.client()
    running.stop()


def test_none_and_auto_answer_in_text_when_the_model_writes_text(auto_client):
    for choice in ("none", "auto"):
        out = auto_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
                                                  tool_choice=choice, max_tokens=8, temperature=0)
        assert out.choices[0].message.tool_calls in (None, []) and isinstance(out.choices[0].message.content, str)


def test_auto_needs_the_flags_as_in_vllm_and_tools_alone_still_get_text(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="auto",
                                       max_tokens=4)
    assert err.value.body["param"] == "tool_choice" and err.value.body["message"] == AUTO_NEEDS_FLAGS
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=4)
    assert out.choices[0].message.tool_calls in (None, []) and isinstance(out.choices[0].message.content, str)


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tool_requests_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **kwargs)
    assert err.value.body["param"] == param


def test_auto_parses_plain_and_wrapped_calls():
    # A plain JSON call is llama3_json's format; one wrapped in <tool_call> tags is hermes'.
    for parser, text in (("llama3_json", '{"name": "get_time", "arguments": {"zone": "utc"}}'),
                         ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')):
        plan = tool_plan([WEATHER, TIME], "auto", parser)
        calls = plan.parser().extract(text).tool_calls
        assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
        assert plan.parser().extract('{"name": "unknown", "arguments": {}}').tool_calls == []
        assert plan.parser().extract("The weather is fine.").tool_calls == []
    assert tool_plan([TIME], "none", "llama3_json").parser() is None
