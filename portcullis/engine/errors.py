"""The engine's one refusal type: a request it cannot serve, naming the field at fault, so
that a front-end can tell the client which field to fix without reading the message."""
from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses. `param` is the request field at fault (OpenAI's `param`:
    `max_tokens`, `prompt`, ...), or None when no single field is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
