"""`llama3_json`: Llama 3.1 / 3.2 JSON tool calls, and the reply of a forced call.

Llama writes a call as a bare JSON object, `{"name": "get_weather", "parameters": {...}}`
(`arguments` is accepted too), either as the whole reply or after `<|python_tag|>`; several calls
are separated by `;`. A reply that does not start with `{` (or the tag) is content.
"""
from __future__ import annotations

from portcullis.engine.server.tool_parsers.core import ToolParser

PYTHON_TAG = "<|python_tag|>"


class JsonCallParser(ToolParser):
    """Calls as bare JSON objects (or a JSON list of them) at the start of the reply (after
    whitespace), or after a `;` that follows a call. Used as it is for forced calls (`tool_choice` "required" or a named
    function), whose reply structured output makes exactly such an object."""

    name = "json"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._at_start = True  # nothing but whitespace (and `;` after a call) since the start or a call

    def _find_block(self, text: str) -> tuple[int, int] | None:
        if self._at_start:
            rest = self._after_separator(text)
            if rest.startswith(("{", "[")):  # a call, or a list of calls (a forced "required" reply)
                return 0, len(text) - len(rest)
            if rest:
                self._at_start = False
        return super()._find_block(text)

    def _held(self, text: str) -> int:
        if self._at_start and not self._after_separator(text):
            return len(text)  # still only whitespace: a call may follow
        return super()._held(text)

    def _after_separator(self, text: str) -> str:
        rest = text.lstrip()
        if self.calls and rest.startswith(";"):
            rest = rest[1:].lstrip()
        return rest

    def _block_ended(self) -> None:
        self._at_start = True


class GenericToolParser(JsonCallParser):
    """`generic`: for a model whose chat template has no tool-call format. The tools are described
    in the system message (`prompts.describe_tools`) and calls are bare JSON objects, as llama.cpp's
    server does for such models, so an agent's "auto" works with any chat model."""

    name = "generic"


class Llama3JsonToolParser(JsonCallParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    special_tokens = True  # <|python_tag|> is a special token in Llama's vocabulary
