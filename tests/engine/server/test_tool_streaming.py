"""Tool calls and reasoning through real servers and the official client, streamed and not.

Random weights never write a call or a `<think>` block by themselves, so the end-to-end tests
steer the reply with a regex (structured output) into the exact text a real model would write,
and check what the server makes of it: content first, then the call's name once and its
arguments in pieces while they are generated, `finish_reason: tool_calls`; reasoning in
`reasoning_content`. Forced calls need no steering: their schema already constrains them.
"""
from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest

from portcullis.engine.server.cli import (
    build_parser,
    server_settings,
    tool_call_parser_default,
)
from portcullis.engine.server.settings import GenerationDefaults

from .conftest import MODEL_NAME, start_server

QWEN_TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call one or more functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return a JSON object with the function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What time is it in UTC?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}

BEFORE = "Sure, let me check.\n"
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Etc/UTC"}}\n</tool_call>'
STEER_CALL = re.escape(BEFORE + CALL)


@pytest.fixture(scope="module")
def qwen_tool_model(checkpoint_factory, tmp_path_factory):
    """A random-weight Qwen2 checkpoint whose chat template asks for Hermes-style calls."""
    folder = tmp_path_factory.mktemp("qwen-tools")
    shutil.copytree(checkpoint_factory("qwen2"), folder, dirs_exist_ok=True)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": QWEN_TOOL_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def qwen_server(qwen_tool_model, tmp_path_factory):
    # What `python -m portcullis.engine MODEL --enable-auto-tool-choice` resolves: the parser from the template.
    args = build_parser().parse_args([str(qwen_tool_model), "--enable-auto-tool-choice", "--no-token",
                                      "--uds", "unused.sock"])
    settings = tool_call_parser_default(server_settings(args, [MODEL_NAME], GenerationDefaults()), qwen_tool_model)
    assert settings.tool_call_parser == "hermes" and settings.enable_auto_tool_choice
    running = start_server(qwen_tool_model, tmp_path_factory.mktemp("qwen-engine"),
                           tool_call_parser=settings.tool_call_parser, enable_auto_tool_choice=True)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reasoning_server(server_model, tmp_path_factory):
    running = start_server(server_model, tmp_path_factory.mktemp("reasoning"), reasoning_parser="qwen3",
                           structured_outputs_in_reasoning=True)
    yield running
    running.stop()


def stream(client, **kw) -> list:
    return list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **kw))


def parts(chunks) -> list[tuple[str, object]]:
    """Each chunk's delta as (kind, value), in order: content, reasoning, a call's name or arguments."""
    out = []
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            if d.content:
                out.append(("content", d.content))
            if getattr(d, "reasoning_content", None):
                out.append(("reasoning", d.reasoning_content))
            for tc in d.tool_calls or []:
                if tc.function.name:
                    out.append(("name", (tc.index, tc.id, tc.type, tc.function.name)))
                if tc.function.arguments:
                    out.append(("arguments", (tc.index, tc.function.arguments)))
    return out


def finish_reasons(chunks) -> list[str]:
    return [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]


# -- forced calls --------------------------------------------------------------------------------------

def test_forced_call_streams_its_arguments_in_pieces(client):
    chunks = stream(client, tools=[WEATHER], tool_choice=FORCED, max_tokens=60, seed=3, logprobs=True,
                    stream_options={"include_usage": True})
    got = parts(chunks)
    names = [v for k, v in got if k == "name"]
    fragments = [v[1] for k, v in got if k == "arguments"]
    assert len(names) == 1 and names[0][0] == 0 and names[0][1].startswith("call_") and names[0][2:] == ("function", "get_weather")
    assert got[0][0] == "name" and all(k == "arguments" for k, _ in got[1:])
    assert len(fragments) >= 3, fragments  # generated piece by piece, not sent whole at the end
    jsonschema.validate(json.loads("".join(fragments)), WEATHER["function"]["parameters"])
    assert finish_reasons(chunks) == ["tool_calls"]
    # Every token's logprob is sent, though the parser held some text back for a while.
    entries = sum(len(c.logprobs.content) for ch in chunks for c in ch.choices if c.logprobs)
    assert entries == chunks[-1].usage.completion_tokens


def test_forced_call_streamed_equals_the_plain_reply(client):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, seed=11, n=2,  # room for a sampled call to end
              parallel_tool_calls=False)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kw)
    chunks = stream(client, **kw)
    for choice in plain.choices:
        got = [tc for ch in chunks for c in ch.choices if c.index == choice.index for tc in c.delta.tool_calls or []]
        streamed = [("".join(tc.function.name or "" for tc in got if tc.index == i),
                     "".join(tc.function.arguments or "" for tc in got if tc.index == i))
                    for i in sorted({tc.index for tc in got})]  # "required" may make several calls
        assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls"


# -- auto: a Hermes-format call in a Qwen-template model ------------------------------------------------

def test_auto_call_streams_content_then_the_call(qwen_server):
    client = qwen_server.client()
    chunks = stream(client, tools=[WEATHER, TIME], extra_body={"guided_regex": STEER_CALL}, max_tokens=80)
    got = parts(chunks)
    kinds = [k for k, _ in got]
    first_call = kinds.index("name")
    assert set(kinds[:first_call]) == {"content"} and kinds.count("content") >= 2  # text before the call streams
    assert "".join(v for k, v in got if k == "content") == BEFORE
    assert kinds[first_call:].count("name") == 1 and set(kinds[first_call + 1 :]) == {"arguments"}
    assert got[first_call][1][3] == "get_time" and got[first_call][1][0] == 0
    fragments = [v[1] for k, v in got if k == "arguments"]
    assert len(fragments) >= 3 and "".join(fragments) == '{"zone": "Etc/UTC"}'
    assert finish_reasons(chunks) == ["tool_calls"]


def test_auto_call_not_streamed(qwen_server):
    out = qwen_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME],
                                                       extra_body={"guided_regex": STEER_CALL}, max_tokens=80)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == BEFORE
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "Etc/UTC"}
    # The template described the tools to the model (and so the prompt counts them).
    plain = qwen_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens


def test_auto_reply_without_a_call_is_content(qwen_server):
    text = "No call: <tool_call> is just a word here."
    kw = dict(tools=[WEATHER], extra_body={"guided_regex": re.escape(text)}, max_tokens=40)
    chunks = stream(qwen_server.client(), **kw)
    assert "".join(v for k, v in parts(chunks) if k == "content") == text
    assert finish_reasons(chunks) == ["stop"]


def test_a_template_without_a_call_format_gets_the_generic_one(server_model):
    """--enable-auto-tool-choice alone used to end the engine for such a model (issue 30)."""
    args = build_parser().parse_args([str(server_model), "--enable-auto-tool-choice", "--no-token"])
    settings = tool_call_parser_default(server_settings(args, [MODEL_NAME], GenerationDefaults()), server_model)
    assert settings.tool_call_parser == "generic"
    args = build_parser().parse_args([str(server_model), "--tool-call-parser", "mistral", "--enable-auto-tool-choice",
                                      "--reasoning-parser", "deepseek_r1", "--structured-outputs-config",
                                      '{"enable_in_reasoning": true}', "--no-token"])
    settings = tool_call_parser_default(server_settings(args, [MODEL_NAME], GenerationDefaults()), server_model)
    assert (settings.tool_call_parser, settings.reasoning_parser, settings.structured_outputs_in_reasoning) == \
        ("mistral", "deepseek_r1", True)


# -- reasoning --------------------------------------------------------------------------------------------

THOUGHT = re.escape("<think>abc</think>answer")


def test_reasoning_streams_as_its_own_deltas(reasoning_server, client):
    # Greedy: sampled, the same text may be spelled with other tokens, and the counts below differ.
    chunks = stream(reasoning_server.client(), extra_body={"guided_regex": THOUGHT}, max_tokens=30,
                    stream_options={"include_usage": True}, temperature=0)
    got = parts(chunks)
    assert [k for k, _ in got][:1] == ["reasoning"] and "".join(v for k, v in got if k == "reasoning") == "abc"
    assert "".join(v for k, v in got if k == "content") == "answer"
    assert [k for k, _ in got].index("content") > max(i for i, (k, _) in enumerate(got) if k == "reasoning")
    assert finish_reasons(chunks) == ["stop"]
    # Usage counts every generated token, reasoning included, as without a reasoning parser.
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body={"guided_regex": THOUGHT},
                                           max_tokens=30, temperature=0)
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert plain.choices[0].message.content == "<think>abc</think>answer"


def test_reasoning_not_streamed(reasoning_server):
    out = reasoning_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                            extra_body={"guided_regex": THOUGHT}, max_tokens=30)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("abc", "answer")
    off = reasoning_server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=30,
        extra_body={"guided_regex": THOUGHT, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "<think>abc</think>answer"
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_structured_output_applies_after_the_reasoning(server_model, tmp_path_factory):
    """vLLM's default: the reasoning runs freely; the constraint starts after </think>. Random
    weights do not close the reasoning in 8 tokens, so all 8 are reasoning, not the forced word."""
    running = start_server(server_model, tmp_path_factory.mktemp("reasoning-free"), reasoning_parser="deepseek_r1")
    try:
        client = running.client()
        out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                             extra_body={"guided_regex": "answer"})
        choice = out.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert choice.message.reasoning_content and out.usage.completion_tokens == 8
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
        assert err.value.body["param"] == "response_format"
        assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2).choices
    finally:
        running.stop()


def test_forced_call_on_the_demo_model_streams_its_arguments(demo_server):
    """Issue 15's own case: the bundled demo model, a forced call, several argument deltas."""
    chunks = list(demo_server.client().chat.completions.create(
        model="demo", messages=MESSAGES, tools=[WEATHER], tool_choice=FORCED, max_tokens=80, seed=1, stream=True))
    got = parts(chunks)
    fragments = [v[1] for k, v in got if k == "arguments"]
    assert [v[2:] for k, v in got if k == "name"] == [("function", "get_weather")]
    assert len(fragments) >= 3, fragments
    jsonschema.validate(json.loads("".join(fragments)), WEATHER["function"]["parameters"])
    assert finish_reasons(chunks) == ["tool_calls"]
