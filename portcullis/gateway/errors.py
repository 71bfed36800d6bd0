"""Error responses (OpenAI's envelope, or Anthropic's on its Messages API), the events that end
a broken stream, and the refusal type every check raises.

A refusal carries the HTTP status, the client-facing message and the audit reason, so the
one place that turns it into a response also writes the single audit line for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from starlette.responses import Response

from portcullis.protocol.errors import ANTHROPIC_PATH_PREFIX, envelope_for

if TYPE_CHECKING:
    from portcullis.gateway.auth.principal import Principal


class Refusal(Exception):
    """A request the gateway will not forward (or could not complete)."""

    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        principal: Principal | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        # Who the caller proved to be, when it is refused all the same (a revoked key with its
        # right secret): the audit line names them, so a reviewer sees who kept using it.
        self.principal = principal
        self.param = param
        self.headers = dict(headers or {})


def error_body(status: int, message: str, code: str | None, param: str | None = None, path: str = "") -> bytes:
    """Serialise the envelope a client of `path` reads (`portcullis.protocol.errors`)."""
    return json.dumps(envelope_for(path, status, message, param, code), separators=(",", ":")).encode()


def stream_error_event(status: int, message: str, code: str, path: str = "") -> bytes:
    """The event that ends a stream the engine broke off: Anthropic's `error` event on its
    Messages API, else an OpenAI error chunk (no `[DONE]` after either)."""
    data = b"data: " + error_body(status, message, code, path=path) + b"\n\n"
    return b"event: error\n" + data if path.startswith(ANTHROPIC_PATH_PREFIX) else data


def responses_error_event(message: str, code: str, sequence_number: int) -> bytes:
    """The event that ends a Responses API stream the engine broke off, numbered after the last
    event relayed; no `response.completed` follows, so the SDKs raise it."""
    data = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": sequence_number}
    return b"event: error\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def error_response(refusal: Refusal, request_id: str, path: str = "") -> Response:
    """`path`: the canonical path the client asked for, which picks the envelope."""
    headers = {"x-request-id": request_id, **refusal.headers}
    body = error_body(refusal.status, refusal.message, refusal.reason, refusal.param, path)
    return Response(body, status_code=refusal.status, headers=headers, media_type="application/json")


# The body for every unknown route: deliberately identical whatever lies behind the gateway.
NOT_FOUND = Refusal(404, "Not found.", "route_not_allowed")
