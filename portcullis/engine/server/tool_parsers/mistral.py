"""`mistral`: Mistral 7B Instruct v0.3 and later (the JSON form). The reply's calls follow the
special token `[TOOL_CALLS]` as one JSON list, `[TOOL_CALLS][{"name": "f", "arguments": {...}},
...]` (a single object is taken as a list of one); text before it is content."""
from __future__ import annotations

from portcullis.engine.server.tool_parsers.core import ToolParser

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    special_tokens = True
