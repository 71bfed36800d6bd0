"""What the console's modules share: the path of its API, the headers of every answer, the
one thread its file reads run in, and small conversions."""

from __future__ import annotations

from datetime import datetime, timezone

import anyio

from portcullis.gateway.errors import Refusal

API = "/api/"
VALUE_MAX = 200  # characters in one query value

SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-resource-policy": "same-origin",
    "cache-control": "no-store",
}

_limiter: anyio.CapacityLimiter | None = None


def response_headers(request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id, **SECURITY_HEADERS}


def limiter() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(1)
    return _limiter


def bad(param: str, message: str) -> Refusal:
    return Refusal(400, f"{param}: {message}", "invalid_console_query", param=param)


def iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def now() -> datetime:
    return datetime.now(timezone.utc)
