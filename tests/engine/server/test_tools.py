"""Tool calling in chat: forced calls always parse and follow the function's schema, `auto`
(with --enable-auto-tool-choice) turns a call in the reply into `tool_calls`, and bad tool
requests are a 400. Streaming and the formats in detail: test_tool_streaming.py and
test_tool_parsers.py."""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic
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
                                         tool_choice="required", max_tokens=60, temperature=1.0, seed=5,
                                         parallel_tool_calls=False)
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


# Nested schemas as clients send them. Pydantic (openai.pydantic_function_tool, instructor) puts
# the models in `$defs`, with anyOf for optionals, oneOf for a discriminated union, enum and const
# for literals, and `$ref` cycles for recursive models; zod-to-json-schema (the Node SDK) uses
# `definitions` and refers to a repeated object by its path. Both define an `Address`, unalike.
class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    country: Literal["fr", "de", "us"]


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int = pydantic.Field(ge=1, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Order(pydantic.BaseModel):
    """Ship an order."""
    to: Address
    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]
    express: bool | None
    stops: list[Address] = pydantic.Field(max_length=2)


class Node(pydantic.BaseModel):
    label: Literal["a", "b"]
    children: list[Node] = pydantic.Field(max_length=2)


ORDER, NODE = openai.pydantic_function_tool(Order), openai.pydantic_function_tool(Node)
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {"home": {"$ref": "#/definitions/Address"}, "work": {"$ref": "#/properties/home"},
                   "when": {"anyOf": [{"type": "string", "enum": ["am", "pm"]}, {"type": "null"}]},
                   "mode": {"const": "train"}},
    "required": ["home", "work", "when", "mode"],
    "additionalProperties": False,
    "definitions": {"Address": {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}},
                                "required": ["zone"], "additionalProperties": False}},
}}}
NESTED = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (ORDER, NODE, BOOK)}


def _valid_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), NESTED[name])
    if name in ("Order", "Node"):
        {"Order": Order, "Node": Node}[name].model_validate_json(arguments)


def test_parse_with_a_nested_pydantic_model_as_tool_and_as_response_format(roomy_client):
    # `.parse()` turns the arguments back into the model; the reply is 200, never a 400 on `$defs`.
    for seed in range(4):
        out = roomy_client.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, tools=[ORDER], max_tokens=200, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "Order"}})
        call = out.choices[0].message.tool_calls[0]
        assert isinstance(call.function.parsed_arguments, Order)
        _valid_call("Order", call.function.arguments)
        out = roomy_client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, response_format=Order,
                                            max_tokens=200, temperature=1.0, seed=seed)
        assert isinstance(out.choices[0].message.parsed, Order)
        jsonschema.validate(json.loads(out.choices[0].message.content), Order.model_json_schema())


def test_forced_call_of_a_recursive_tool(roomy_client):
    # A random model may nest the tree past max_tokens: only finished calls can be checked.
    finished = 0
    for seed in range(6):
        out = roomy_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[NODE], max_tokens=200, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "Node"}})
        if out.choices[0].finish_reason == "tool_calls":
            _valid_call("Node", out.choices[0].message.tool_calls[0].function.arguments)
            finished += 1
    assert finished >= 3


def test_required_call_among_tools_whose_definitions_share_a_name(roomy_client):
    for seed in range(4):
        out = roomy_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[ORDER, BOOK, NODE],
                                             tool_choice="required", max_tokens=200, temperature=1.0, seed=seed,
                                             parallel_tool_calls=False)
        assert out.choices[0].finish_reason == "tool_calls"
        [call] = out.choices[0].message.tool_calls
        _valid_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "book"}}, "required"])
def test_streamed_forced_call_with_nested_schemas(roomy_client, tool_choice):
    chunks = list(roomy_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[ORDER, BOOK], tool_choice=tool_choice, max_tokens=200,
        stream=True, temperature=1.0, seed=1, parallel_tool_calls=False))
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    [name] = [d.function.name for d in deltas if d.function.name]
    _valid_call(name, "".join(d.function.arguments or "" for d in deltas))
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


def test_call_schema_rebases_local_references():
    plan = tool_plan([ORDER, BOOK], "required")
    schema = plan.call_schema()
    book = schema["items"]["anyOf"][1]["properties"]["arguments"]
    assert book["properties"]["work"] == {"$ref": "#/items/anyOf/1/properties/arguments/properties/home"}
    assert book["properties"]["mode"] == {"const": "train"}
    assert BOOK["function"]["parameters"]["properties"]["work"] == {"$ref": "#/properties/home"}  # not changed
    node = tool_plan([NODE], {"type": "function", "function": {"name": "Node"}}).call_schema()
    assert node["properties"]["arguments"]["$defs"]["Node"]["properties"]["children"]["items"] == {
        "$ref": "#/properties/arguments/$defs/Node"}
    # Data that looks like a reference stays as it is.
    const = {"type": "object", "properties": {"x": {"const": {"$ref": "#/a"}}, "enum": {"$ref": "#/$defs/E"}}}
    got = tool_plan([{"type": "function", "function": {"name": "f", "parameters": const}}], "required").call_schema()
    assert got["items"]["anyOf"][0]["properties"]["arguments"]["properties"] == {
        "x": {"const": {"$ref": "#/a"}}, "enum": {"$ref": "#/items/anyOf/0/properties/arguments/$defs/E"}}


# -- the generic format: "auto" with a model whose template has no tool syntax (issue 30) -------------

@pytest.fixture
def generic(agent_server):
    return agent_server


@pytest.fixture
def roomy_client(generic):
    return generic.client()


def _rendered(server, **body) -> str:
    with server.http() as http:
        tokens = http.post("/tokenize", json={"model": MODEL_NAME, **body}).json()["tokens"]
        return http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json()["prompt"]


def test_a_template_without_tools_gets_them_described_in_the_system_message(generic):
    """The demo template ignores `tools`: without the description the model would never know them."""
    plain = _rendered(generic, messages=MESSAGES)
    described = _rendered(generic, messages=MESSAGES, tools=[WEATHER, TIME])
    assert "get_weather" not in plain and "system" not in plain
    assert described.index("get_weather") < described.index("get_time") < described.index("What is the weather")
    assert '"arguments"' in described and "Current weather in a city." in described
    with_system = _rendered(generic, messages=[{"role": "system", "content": "Be brief."}, *MESSAGES], tools=[WEATHER])
    assert with_system.count("system") == 1 and with_system.index("get_weather") < with_system.index("Be brief.")


def test_past_calls_and_their_results_are_rendered_as_text(generic):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    text = _rendered(generic, messages=history, tools=[WEATHER])
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    assert "18 degrees, sunny" in text


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_generic_call_and_answers_text_otherwise(generic, stream):
    """What the model writes is forced here (guided_regex), as a trained model would write it."""
    client = generic.client()
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    kw = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=60)
    if not stream:
        out = client.chat.completions.create(**kw, extra_body={"guided_regex": _escaped(call)})
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
        [made] = out.choices[0].message.tool_calls
    else:
        chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"guided_regex": _escaped(call)}))
        deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
        made = deltas[0]
        made.function.arguments = "".join(d.function.arguments or "" for d in deltas)
        assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]
    assert made.function.name == "get_weather"
    assert json.loads(made.function.arguments) == {"city": "Paris", "unit": "c"}
    text = client.chat.completions.create(**kw, extra_body={"guided_regex": "It is sunny\\."})
    assert text.choices[0].message.content == "It is sunny." and not text.choices[0].message.tool_calls


def _escaped(text: str) -> str:
    return re.escape(text)


def test_required_makes_a_list_of_calls_and_parallel_false_makes_one(roomy_client):
    """As vLLM: "required" is one or more calls (an agent may ask for several at once), each of a
    given function with valid arguments; `parallel_tool_calls: false` allows one."""
    city = {"type": "function", "function": {"name": "get_city", "parameters": {
        "type": "object", "properties": {"name": {"enum": ["Paris", "Oslo"]}}, "required": ["name"],
        "additionalProperties": False}}}
    schemas = {"get_city": city, "get_time": TIME}
    counts = {}
    for parallel in (True, False):
        for seed in range(8):
            out = roomy_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[city, TIME],
                                                 tool_choice="required", max_tokens=400, temperature=1.0, seed=seed,
                                                 parallel_tool_calls=parallel)
            choice = out.choices[0]
            if choice.finish_reason != "tool_calls":
                continue  # cut at max_tokens: arguments unfinished
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name]["function"]["parameters"])
            counts.setdefault(parallel, []).append(len(choice.message.tool_calls))
            if parallel and len(choice.message.tool_calls) > 1:  # streamed, the same calls arrive one by one
                chunks = list(roomy_client.chat.completions.create(
                    model=MODEL_NAME, messages=MESSAGES, tools=[city, TIME], tool_choice="required", max_tokens=400,
                    temperature=1.0, seed=seed, stream=True))
                deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
                streamed = [("".join(d.function.name or "" for d in deltas if d.index == i),
                             "".join(d.function.arguments or "" for d in deltas if d.index == i))
                            for i in sorted({d.index for d in deltas})]
                assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert counts[False] and set(counts[False]) == {1}
    assert max(counts[True]) > 1, counts  # several calls happen (sampled from random weights: fixed seeds)
    assert counts[True] and min(counts[True]) >= 1
    schema = tool_plan([WEATHER, TIME], "required").call_schema()
    assert (schema["type"], schema["minItems"], "maxItems" in schema) == ("array", 1, False)
    assert tool_plan([WEATHER, TIME], "required", parallel=False).call_schema()["maxItems"] == 1
