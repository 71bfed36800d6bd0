"""What one request may ask for, checked before any work: the chat template arguments a client
may pass, and how deeply a body may nest.
"""
from __future__ import annotations

from typing import Any

from engine.server.errors import MAX_JSON_DEPTH

# The chat_template_kwargs real templates read (Qwen3, DeepSeek, gpt-oss, Qwen2-VL, Llama 3),
# as short scalars. Anything else could reach the template renderer as code (`chat_template`)
# or as unbounded data (`tools`, `documents`: those have their own request fields).
CHAT_TEMPLATE_KWARGS = frozenset({
    "enable_thinking", "thinking", "reasoning_effort", "add_vision_id", "tools_in_user_message", "date_string",
})
MAX_TEMPLATE_KWARG_CHARS = 128


def template_kwargs_problem(kwargs: dict[str, Any]) -> str | None:
    """Why these chat_template_kwargs are refused, or None when they are fine."""
    allowed = ", ".join(sorted(CHAT_TEMPLATE_KWARGS))
    for key, value in kwargs.items():
        if key not in CHAT_TEMPLATE_KWARGS:
            return (f"{key!r} is not allowed; the template takes only {allowed}. Tools go in 'tools'; "
                    "the model's own chat template is always used")
        if not (value is None or isinstance(value, (bool, int, float, str))):
            return f"{key!r} must be a boolean, number or string"
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS:
            return f"{key!r} must be at most {MAX_TEMPLATE_KWARG_CHARS} characters"
    return None


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
