"""`hermes`: Hermes 2 Pro and later, Qwen2.5 and Qwen3. Each call is a JSON object between tags,
`<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`, one block
per call; text before the first block is content."""
from __future__ import annotations

from portcullis.engine.server.tool_parsers.core import ToolParser, held_marker_length

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def _block_end(self, body: str, final: bool) -> tuple[str, int] | None:
        end = body.find(CLOSE)
        if end >= 0:
            return body[:end], end + len(CLOSE)
        return (body, len(body)) if final else None  # a reply that stopped before closing the tag

    def _partial_text(self, body: str) -> str:
        return body[: len(body) - held_marker_length(body, (CLOSE,))]
