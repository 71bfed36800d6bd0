"""What one request may ask for, checked before any work: how deeply a body may nest.
"""
from __future__ import annotations

from typing import Any

from engine.server.errors import MAX_JSON_DEPTH


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON nests deeper than `limit` (iteratively: no recursion to exhaust)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
