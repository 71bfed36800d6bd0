"""The error body both halves answer with: OpenAI's envelope, `{"error": {message, type, param,
code}}`, whose `type` the status decides. The SDKs map these to their exception classes, so one
status must read the same whichever half refused."""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "client_disconnected",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_envelope(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param, "code": code}}
