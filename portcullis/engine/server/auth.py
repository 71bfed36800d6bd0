"""The internal token: every route but `/health` needs `Authorization: Bearer <token>`.

This is ASGI middleware rather than a per-route dependency on purpose: it also covers paths
that match no route, so a caller without the token learns nothing (not even which routes
exist) and a route added later cannot forget it. The comparison is constant-time.
"""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from portcullis.engine.server.errors import error_body

PUBLIC_PATHS = frozenset({"/health"})


class InternalTokenMiddleware:
    def __init__(self, app: ASGIApp, token: str | None):
        self.app = app
        self._expected = None if token is None else f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._expected is None or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = error_body(401, "missing or invalid internal token", code="invalid_api_key")
        await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        # "Bearer" is case-insensitive (RFC 7235); normalise it, never the token itself.
        if given[:7].lower() == b"bearer ":
            given = b"Bearer " + given[7:].strip()
        return hmac.compare_digest(given, self._expected)
