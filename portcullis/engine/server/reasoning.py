"""Reasoning output (vLLM's `--reasoning-parser`): a reply's `<think>…</think>` part becomes
`reasoning_content`, what follows it `content`.

* `deepseek_r1`: the template opens `<think>` in the prompt, so the model may not write it;
  everything up to `</think>` is reasoning, and a reply that never closes it is all reasoning.
* `qwen3`: the same, except that with `chat_template_kwargs: {"enable_thinking": false}` there is
  no reasoning at all, as vLLM's Qwen3 parser has it.
Either way, a `<think>` the model writes at the start is dropped, and a prompt that already ends
with `</think>` (Qwen3's template with thinking off) leaves nothing to reason: all is content.

Structured output applies to the content only, as in vLLM: `after_reasoning` builds a grammar
that lets the reasoning run freely up to `</think>` and constrains what follows.
"""
from __future__ import annotations

import json

from portcullis.engine.core.structured_output import JSON_OBJECT_SCHEMA
from portcullis.engine.errors import RequestError
from portcullis.engine.sampling_params import StructuredOutputsParams
from portcullis.engine.server.tool_parsers.core import held_marker_length

THINK, END_THINK = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def replies_reason(parser: str | None, prompt_text: str | None, template_kwargs: dict | None) -> bool:
    """Whether a request's replies start with reasoning: not without a parser, not with Qwen3's
    thinking turned off, and not after a prompt that already closed the reasoning."""
    if parser is None:
        return False
    if parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
        return False
    return prompt_text is None or not prompt_text.rstrip().endswith(END_THINK)


class ReasoningParser:
    """Splits a reply into reasoning and content while it streams: `feed` returns delta dicts
    (`{"reasoning_content": ...}` or `{"content": ...}`), `finish` ends the reply."""

    def __init__(self):
        self._buf = ""
        self._state = "start"  # start (a <think> may open the reply), reasoning, content

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        return self._advance(final=True)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply as (reasoning, content), on a parser that has not been fed yet."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        return reasoning or None, content or None

    def _advance(self, final: bool) -> list[dict]:
        out: list[dict] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if not final and THINK.startswith(head):
                return out  # the reply may still open with <think>
            if head.startswith(THINK):
                self._buf = head[len(THINK) :]
            self._state = "reasoning"
        if self._state == "reasoning":
            end = self._buf.find(END_THINK)
            if end >= 0:
                thought, self._buf = self._buf[:end], self._buf[end + len(END_THINK) :]
                self._state = "content"
            else:
                keep = 0 if final else held_marker_length(self._buf, (END_THINK,))
                thought, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            if thought:
                out.append({"reasoning_content": thought})
        if self._state == "content" and self._buf:
            out.append({"content": self._buf})
            self._buf = ""
        return out


def after_reasoning(spec: StructuredOutputsParams) -> str:
    """An EBNF grammar (xgrammar's dialect) for a reply that reasons freely up to `</think>` and
    then follows `spec`. Blocking (a big schema takes a while): run it in the grammar thread.
    The kinds of `spec` map to grammars as `engine.structured_output.GrammarCompiler` maps them.
    Raises `RequestError` when xgrammar cannot read the client's schema, regex or grammar."""
    import xgrammar as xgr

    content = _client_grammar(spec)
    thinking = {"type": "structural_tag",
                "format": {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": END_THINK}}
    return str(xgr.Grammar.concat(xgr.Grammar.from_structural_tag(json.dumps(thinking)), content))


def _client_grammar(spec: StructuredOutputsParams):
    """The grammar of what the client asked for. xgrammar (0.2.9) reports a schema, regex or
    grammar it cannot read as a RuntimeError from its parsers (its InvalidJSONError is one); its
    ValueError and TypeError mean an argument of the wrong type, a fault of ours, as is any
    failure of the reasoning's own grammar: those stay errors, answered 500."""
    import xgrammar as xgr

    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        if spec.json_object:
            return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except RuntimeError as exc:
        raise RequestError(str(exc)) from exc
