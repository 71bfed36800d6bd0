"""Tool-call parsers: the formats in which models write tool calls, read while they stream.

Owns: one module per format (`hermes`, `json_calls` for `llama3_json`, forced calls and the
`generic` format of templates that have none, `mistral`), the streaming core they share (`core.ToolParser`: `feed` each new piece of text,
`finish` at the end, `extract` a whole reply), the registry under vLLM's `--tool-call-parser`
names, and the default picked from a chat template when the template says which format it asks
for. Imports nothing of the engine's; the chat route builds one parser per choice.
"""
from __future__ import annotations

from portcullis.engine.server.tool_parsers.core import Extracted, ToolParser, compact_deltas, merge
from portcullis.engine.server.tool_parsers.hermes import HermesToolParser
from portcullis.engine.server.tool_parsers.json_calls import (
    PYTHON_TAG,
    GenericToolParser,
    JsonCallParser,
    Llama3JsonToolParser,
)
from portcullis.engine.server.tool_parsers.mistral import TOOL_CALLS, MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, GenericToolParser)
}

# What a chat template writes when it describes the format it wants calls in.
_TEMPLATE_SIGNS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "mistral": (TOOL_CALLS,),
    "llama3_json": (PYTHON_TAG, "ipython"),
}


def parser_from_template(template: str | dict | None) -> str | None:
    """The parser a chat template asks for: the format whose signs appear in it; `generic` when
    none do; None when several do (the operator must say which)."""
    text = "\n".join(template.values()) if isinstance(template, dict) else (template or "")
    named = [name for name, signs in _TEMPLATE_SIGNS.items() if any(s in text for s in signs)]
    return named[0] if len(named) == 1 else GenericToolParser.name if not named else None


__all__ = ["TOOL_PARSERS", "Extracted", "JsonCallParser", "ToolParser", "compact_deltas", "merge", "parser_from_template"]
