"""Named Server-Sent Events (`event: <type>` then `data: <json>`), as Anthropic's Messages API
and OpenAI's Responses API stream them."""
from __future__ import annotations

import json
from typing import Any


def named_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event type, data) of each SSE event in a stream's text."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out
