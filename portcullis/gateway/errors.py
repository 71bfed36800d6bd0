"""OpenAI-shaped error responses and the refusal type every check raises.

A refusal carries the HTTP status, the client-facing message and the audit reason, so the
one place that turns it into a response also writes the single audit line for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from starlette.responses import Response

if TYPE_CHECKING:
    from portcullis.gateway.auth.principal import Principal

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_disconnected",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


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


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> bytes:
    """Serialise the OpenAI error envelope `{"error": {message, type, param, code}}`."""
    payload = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "api_error"),
            "param": param,
            "code": code,
        }
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def error_response(refusal: Refusal, request_id: str) -> Response:
    headers = {"x-request-id": request_id, **refusal.headers}
    body = error_body(refusal.status, refusal.message, refusal.reason, refusal.param)
    return Response(body, status_code=refusal.status, headers=headers, media_type="application/json")


# The body for every unknown route: deliberately identical whatever lies behind the gateway.
NOT_FOUND = Refusal(404, "Not found.", "route_not_allowed")
