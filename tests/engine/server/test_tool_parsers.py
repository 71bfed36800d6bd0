"""Tool-call and reasoning parsers on fixed replies: each format's whole-reply result, and the same
result however the reply is cut into deltas (at every character boundary, and one character at a
time), with each call's name sent once before its arguments."""
from __future__ import annotations

import json
import random

import pytest

from portcullis.engine.server.reasoning import ReasoningParser, after_reasoning, replies_reason
from portcullis.engine.server.reply import ReplyFormat
from portcullis.engine.server.tool_parsers import (
    TOOL_PARSERS,
    JsonCallParser,
    merge,
    parser_from_template,
)
from portcullis.engine.server.tools import tool_plan

TOOLS = {"get_weather", "get_time"}
WEATHER_ARGS = {"city": "Zürich \"old town\"", "days": [1, 2], "hourly": True, "note": None, "t": -1.5e3}
CALL = json.dumps({"name": "get_weather", "arguments": WEATHER_ARGS}, ensure_ascii=False)
EXPECTED_ARGS = json.dumps(WEATHER_ARGS, ensure_ascii=False)

# (parser, reply, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f"<tool_call>\n{CALL}\n</tool_call>", None, [("get_weather", EXPECTED_ARGS)]),
    ("hermes", f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
               '{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n',
     "Let me look.\n", [("get_weather", EXPECTED_ARGS), ("get_time", '{"zone": "utc"}')]),
    ("hermes", f"<tool_call>\n{CALL}", None, [("get_weather", EXPECTED_ARGS)]),  # stopped before the end tag
    ("hermes", "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",  # not a given function
     "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>", []),
    ("hermes", "Use <tool_call> tags for calls, like <tool_call>{oops}</tool_call>.",  # not JSON: text
     "Use <tool_call> tags for calls, like <tool_call>{oops}</tool_call>.", []),
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "utc"}}', None, [("get_time", '{"zone": "utc"}')]),
    ("llama3_json", f'  {CALL}; {{"name": "get_time", "parameters": {{}}}}', None,
     [("get_weather", EXPECTED_ARGS), ("get_time", "{}")]),
    ("llama3_json", f"<|python_tag|>{CALL}", None, [("get_weather", EXPECTED_ARGS)]),
    ("llama3_json", 'The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    ("mistral", f'[TOOL_CALLS][{CALL}, {{"name": "get_time", "arguments": {{"zone": "local"}}}}]', None,
     [("get_weather", EXPECTED_ARGS), ("get_time", '{"zone": "local"}')]),
    ("mistral", f"Checking.[TOOL_CALLS]{CALL}", "Checking.", [("get_weather", EXPECTED_ARGS)]),
    ("mistral", "Plain [TOOL words].", "Plain [TOOL words].", []),
]


def run(parser, pieces: list[str]) -> list[dict]:
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish()


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def check_call_deltas(deltas: list[dict]) -> None:
    """Each call's first delta carries its id, type and name (once); the rest only arguments."""
    seen = set()
    for d in deltas:
        assert len(d) == 1 and next(iter(d.values())) != ""
        for tc in d.get("tool_calls", []):
            first = tc["index"] not in seen
            seen.add(tc["index"])
            assert ("name" in tc["function"]) == first == ("id" in tc) == ("type" in tc)


@pytest.mark.parametrize("name, reply, content, calls", CASES)
def test_a_reply_parses_the_same_however_it_is_split(name, reply, content, calls):
    whole = TOOL_PARSERS[name](TOOLS).extract(reply)
    assert whole.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole.tool_calls)
    for pieces in splits(reply):
        deltas = run(TOOL_PARSERS[name](TOOLS), pieces)
        check_call_deltas(deltas)
        got = merge(deltas)
        assert got.content == whole.content, pieces
        assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls], pieces


def test_arguments_stream_as_they_are_generated():
    parser = TOOL_PARSERS["hermes"](TOOLS)
    deltas = run(parser, list(f"<tool_call>\n{CALL}\n</tool_call>"))
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", [])][1:]
    assert len(fragments) > 20 and "".join(fragments) == EXPECTED_ARGS
    # The name goes out as soon as it is complete, long before the arguments end.
    first = TOOL_PARSERS["hermes"](TOOLS).feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zü')
    assert first == [{"tool_calls": [{"index": 0, "id": first[0]["tool_calls"][0]["id"], "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Zü'}}]}]


def test_content_streams_at_once_and_only_a_possible_marker_waits():
    parser = TOOL_PARSERS["hermes"](TOOLS)
    assert parser.feed("Hello") == [{"content": "Hello"}]
    assert parser.feed(" <tool") == [{"content": " "}]  # "<tool" may open a call
    assert parser.feed("box>") == [{"content": "<toolbox>"}]


def test_escaped_unicode_split_inside_a_surrogate_pair():
    reply = '<tool_call>{"name": "get_time", "arguments": {"zone": "\\ud83d\\ude00 utc"}}</tool_call>'
    for pieces in splits(reply):
        got = merge(run(TOOL_PARSERS["hermes"](TOOLS), pieces))
        assert got.tool_calls[0]["function"]["arguments"] == '{"zone": "\U0001F600 utc"}'


def test_forced_call_parser_reads_the_constrained_reply():
    plan = tool_plan([{"type": "function", "function": {"name": "get_time"}}], {"type": "function", "function": {"name": "get_time"}})
    parser = plan.parser()
    assert isinstance(parser, JsonCallParser)
    got = parser.extract('{"name": "get_time", "arguments": {"zone": "utc"}}')
    assert got.content is None and got.tool_calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}


def test_plans_pick_their_parser():
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    assert tool_plan(tools, "none", "hermes").parser() is None
    assert tool_plan(tools, None).parser() is None  # auto tool choice off: the reply is text
    assert type(tool_plan(tools, None, "mistral").parser()).name == "mistral"
    assert type(tool_plan(tools, "required").parser()) is JsonCallParser


@pytest.mark.parametrize("template, name", [
    ("{% if tools %}<tools>{{ tools }}</tools> ... <tool_call>{\"name\": ...}</tool_call>{% endif %}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{{- '<|start_header_id|>ipython<|end_header_id|>' }}{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),  # no format of its own
    ("<tool_call> and [TOOL_CALLS] both", None),  # ambiguous: no default
    ({"default": "plain", "tool_use": "<tool_call>"}, "hermes"),
    (None, "generic"),
])
def test_default_parser_from_the_chat_template(template, name):
    assert parser_from_template(template) == name


# -- reasoning ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("reply, reasoning, content", [
    ("<think>abc</think>answer", "abc", "answer"),
    ("abc</think>answer", "abc", "answer"),  # the template opened <think>
    ("\n<think>\nabc\n</think>\n\nanswer", "\nabc\n", "\n\nanswer"),
    ("abc, still thinking", "abc, still thinking", None),  # cut off before </think>
    ("<think>abc</think>", "abc", None),
    ("</think>answer", None, "answer"),
    ("a <think> b</think>c", "a <think> b", "c"),
])
def test_reasoning_splits_the_same_however_it_is_split(reply, reasoning, content):
    assert ReasoningParser().extract(reply) == (reasoning, content)
    for pieces in splits(reply):
        deltas = run(ReasoningParser(), pieces)
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)
        joined = ("".join(d.get("reasoning_content", "") for d in deltas) or None,
                  "".join(d.get("content", "") for d in deltas) or None)
        assert joined == (reasoning, content), pieces


def test_when_replies_reason():
    assert replies_reason("deepseek_r1", "<|im_start|>assistant\n<think>\n", None)
    assert replies_reason("qwen3", "<|im_start|>assistant\n", {})
    assert not replies_reason("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False})
    assert not replies_reason("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {})
    assert not replies_reason(None, "x", None)


def test_tool_calls_are_read_from_the_content_only():
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    reply = ReplyFormat(reasons=True, tools=tool_plan(tools, None, "hermes"))
    text = ('I could write <tool_call>{"name": "get_time", "arguments": {}}</tool_call> here.</think>'
            'Sure.<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>')
    message = reply.message(text)
    assert message["reasoning_content"].startswith("I could write <tool_call>")
    assert message["content"] == "Sure." and len(message["tool_calls"]) == 1
    for pieces in splits(text):
        parser = reply.parser()
        deltas = run(parser, pieces)
        assert "".join(d.get("content", "") for d in deltas) == "Sure." and parser.called
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]


def test_structured_output_after_reasoning_constrains_only_what_follows():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from portcullis.engine.assets import DEMO_MODEL_DIR
    from portcullis.engine.sampling_params import StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=4096, stop_token_ids=[0]))
    grammar = compiler.compile_grammar(after_reasoning(StructuredOutputsParams(regex="answer")))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(t) for t in tok.encode(text)) and matcher.accept_token(0)

    assert accepts("any thought < at all </thi </think>answer")
    assert not accepts("answer")  # still reasoning: the end token is not allowed yet
    assert not accepts("abc</think>other")


def test_a_call_cut_short_is_the_same_call_streamed_or_not():
    reply = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Par'  # max_tokens hit
    for pieces in splits(reply):
        got = merge(run(TOOL_PARSERS["hermes"](TOOLS), pieces))
        assert got.content is None and [c["function"] for c in got.tool_calls] == \
            [{"name": "get_time", "arguments": '{"zone": "Europe/Par'}]


PIECES = ["{", "}", "[", "]", '"', ":", ",", " ", "\n", "\\", "u", "1", "-", ".", "e", "t", "n", "x", "null", "true",
          "name", "arguments", "get_time", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", ";",
          '"name": "get_time"', '"arguments": {', "\\ud83d", "<think>", "</think>", "<",
          '{"name": "get_time", "arguments": ']


@pytest.mark.parametrize("name", [*TOOL_PARSERS, "forced"])
def test_any_text_parses_without_error_and_calls_do_not_depend_on_the_split(name):
    """Random replies made of JSON and marker pieces: no exception, every delta encodes as UTF-8,
    and a reply whose whole text holds calls gives the same calls and content however it is cut.
    (A block whose JSON breaks after its name was sent stays a call when streamed; that is the
    one case where a whole-text parse, which sees the break first, says text.)"""
    rng = random.Random(name)
    cls = JsonCallParser if name == "forced" else TOOL_PARSERS[name]
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.05:
            text = '<tool_call>{"name": "get_time", "arguments": ' + "[" * 3000 + text  # nested past recursion
        whole = cls(TOOLS).extract(text)
        pieces, i = [], 0
        while i < len(text):
            step = rng.randint(1, 6)
            pieces.append(text[i : i + step])
            i += step
        deltas = run(cls(TOOLS), pieces)
        json.dumps(deltas, ensure_ascii=False).encode()
        got = merge(deltas)
        if whole.tool_calls:
            assert got.content == whole.content, text
            assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls], text
