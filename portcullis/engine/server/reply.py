"""How a chat reply's text becomes the parts of OpenAI's assistant message: reasoning first (with
a reasoning parser), then content and tool calls (with tools), the same way whether the reply
streams or arrives whole. One `ReplyFormat` per request; one `ReplyParser` per choice."""
from __future__ import annotations

from dataclasses import dataclass

from portcullis.engine.server.reasoning import ReasoningParser
from portcullis.engine.server.tool_parsers import ToolParser, compact_deltas, merge
from portcullis.engine.server.tools import ToolPlan


@dataclass(frozen=True)
class ReplyFormat:
    reasons: bool  # the reply starts with reasoning (see `reasoning.replies_reason`)
    tools: ToolPlan | None

    @property
    def plain(self) -> bool:
        """Nothing to parse: the text is the content."""
        return not self.reasons and (self.tools is None or self.tools.parser_class is None)

    def parser(self) -> ReplyParser:
        return ReplyParser(ReasoningParser() if self.reasons else None, self.tools.parser() if self.tools else None)

    def message(self, text: str, echo: str = "") -> dict:
        """The assistant message of a whole reply (its `tool_calls` empty when there are none)."""
        parser = self.parser()
        deltas = parser.feed(text) + parser.finish()
        whole = merge(deltas)
        content = None if whole.content is None else echo + whole.content
        message = {"role": "assistant", "content": content, "tool_calls": whole.tool_calls}
        if self.reasons:
            message["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas) or None
            message["content"] = content or None  # as vLLM: no text after the reasoning is null
        return message


class ReplyParser:
    """One choice's reply as it streams: `feed` each new piece of text and get OpenAI delta dicts
    (`reasoning_content`, `content` or `tool_calls`); `finish` at its end."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def called(self) -> bool:
        """Whether the reply made tool calls (its finish reason is then "tool_calls")."""
        return self.tools is not None and bool(self.tools.calls)

    def feed(self, text: str) -> list[dict]:
        parts = self.reasoning.feed(text) if self.reasoning else [{"content": text}]
        return compact_deltas(self._content(parts, final=False))

    def finish(self) -> list[dict]:
        parts = self.reasoning.finish() if self.reasoning else []
        return compact_deltas(self._content(parts, final=True))

    def _content(self, parts: list[dict], final: bool) -> list[dict]:
        """Tool calls are read from the content part only."""
        if self.tools is None:
            return [p for p in parts if next(iter(p.values()))]
        out = []
        for p in parts:
            out += self.tools.feed(p["content"]) if "content" in p else [p]
        return out + (self.tools.finish() if final else [])
