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


# Anthropic's Messages API (`/v1/messages`) has its own envelope and type names; its SDK maps
# the status to an exception class as OpenAI's does.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def anthropic_envelope(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def envelope_for(path: str, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """The error body a client of `path` reads: Anthropic's on its Messages API, else OpenAI's."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        return anthropic_envelope(status, message)
    return error_envelope(status, message, param, code)
