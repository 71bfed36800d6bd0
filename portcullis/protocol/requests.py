"""How a generating request's fields are read, the same on both sides of the private channel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Both names on both routes, the first one set winning: OpenAI's chat renamed `max_tokens` to
# `max_completion_tokens`; clients send either, and to either route.
MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


def asked_max_tokens(fields: Mapping[str, Any]) -> int | None:
    """The completion length a request asks for, or None when it names none (an integer field
    only: the caller has checked the types)."""
    for name in MAX_TOKEN_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
