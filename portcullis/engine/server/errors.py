"""OpenAI-shaped errors: one exception type the routes raise, and the handlers that turn it,
FastAPI's validation errors and Starlette's HTTP errors into `{"error": {...}}` bodies.

Malformed JSON, JSON nested too deeply and wrong types are the client's fault and answer 400,
never 422 or 500.
"""
from __future__ import annotations

from collections.abc import Mapping

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from portcullis.engine.errors import RequestError
from portcullis.protocol.errors import envelope_for
from portcullis.protocol.errors import error_envelope as error_body  # noqa: F401 - the envelope both halves answer with
from portcullis.protocol.json_body import too_deep_message

log = structlog.get_logger("portcullis.engine.server")

TOO_DEEP = too_deep_message()  # the gateway says the same

class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """OpenAI's error body, or Anthropic's on its Messages API's routes."""
    body = envelope_for(path, err.status, err.message, err.param, err.code)
    return JSONResponse(body, err.status, headers=err.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    """The engine's refusal of a request (`SamplingParams`, the core's checks): a 400 naming the field."""
    return error_response(bad_request(str(exc), exc.param), request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # the top-level field; the message has the full path
    if first.get("type") == "json_invalid":  # its loc is a position in the text, not a field
        message, param = "the request body is not valid JSON", None
    elif first.get("type") == "json_too_deep":
        message = TOO_DEEP
    elif param is None:
        message = "the request body must be a JSON object"
    else:
        message = f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}"
    return error_response(bad_request(message, param), request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body", from json
        message = TOO_DEEP
    return error_response(APIError(exc.status_code, message, headers=exc.headers), request.url.path)


class InternalErrors:
    """A fault of ours is never reported as the client's (only `RequestError` and `APIError`
    are): it is a 500 naming the request id, which the log line carries with the traceback. Caught
    here, inside the request-id layer, rather than left to Starlette's outermost handler, which
    answers without our headers and then lets the server drop the connection: the gateway's
    next request on that kept-alive connection would fail with it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            rid = scope.get("state", {}).get("request_id")
            log.exception("unhandled error", path=scope.get("path"), request_id=rid)
            if started:
                raise  # mid-response: the server can only close the connection
            err = APIError(500, f"internal error in the engine server (request id {rid}); it is logged",
                           code="internal_error")
            await error_response(err, scope.get("path", ""))(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
