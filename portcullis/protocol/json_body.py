"""The shape a JSON request body may have, checked on the raw bytes before anything parses it.

Parsing is the first work a request costs, and it is paid on an event loop that every other
request shares: 380,000 `[[]]` in 1.9 MB kept `json.loads` busy 0.5 s per parse, and each half
parsed it once. So the arrays and objects a body holds are counted first, at C speed, and a body
with more than any real request has is refused before it is parsed. Depth is checked after the
parse, on a tree this count has already bounded.
"""

from __future__ import annotations

import re
from typing import Any

# Deeper than any real request (a JSON Schema with 30 nested objects); a deeper one would cost
# the grammar compiler seconds, and past ~1,000 levels Python's parser gives up.
MAX_JSON_DEPTH = 64
# Arrays and objects in one body. The largest real ones: 2,048 chat messages, each an object
# with a list of content parts (about 6,000), or 128 tools with their JSON Schemas. json.loads
# takes about 2 ms per 1,000 of them here, so this caps a parse near 30 ms.
MAX_JSON_CONTAINERS = 16_384
# A JSON string, escapes included (the unrolled form: no backtracking, about 20 ms a MB here).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_CONTAINERS = frozenset({dict, list})  # exactly what json.loads builds


def too_many_containers(raw: bytes, limit: int = MAX_JSON_CONTAINERS) -> bool:
    """Whether `raw` holds more than `limit` arrays and objects. Brackets are counted first,
    strings included (nanoseconds a byte); only a body over the limit by that count, such as a
    prompt full of code, has its strings taken out and its brackets counted again. The count is
    of UTF-8 text: a caller parses nothing else (in UTF-16 an escaped quote fools the strings)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    outside = _STRING.sub(b"", raw)
    return outside.count(b"[") + outside.count(b"{") > limit


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON nests deeper than `limit`. Iterative, so there is no recursion to
    exhaust; a list or object of plain values is passed over at C speed (`map(type, ...)`):
    1.5M stop_token_ids cost 0.1 s here, where a loop in Python took 0.8 s."""
    stack = [(value, 1)] if type(value) in _CONTAINERS else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if type(item) is dict else item
        if _CONTAINERS.isdisjoint(map(type, children)):
            continue
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)
    return False


def too_many_message(limit: int = MAX_JSON_CONTAINERS) -> str:
    return f"The request body holds more than {limit} JSON arrays and objects."


def too_deep_message(limit: int = MAX_JSON_DEPTH) -> str:
    return f"The request body is nested too deeply (more than {limit} levels)."
