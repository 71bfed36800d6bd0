"""The engine's first look at a request body: more JSON arrays and objects than any real request
holds is a 400 before FastAPI parses it, since it is the parse that costs, on the event loop every
request shares (`portcullis.protocol.json_body`, the gateway's rule too). ASGI middleware, inside
the token check: an unauthenticated caller is refused before its body is read."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from portcullis.engine.server.errors import bad_request, error_response
from portcullis.protocol.json_body import too_many_containers, too_many_message


class JsonShapeMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body, last = await _read_body(receive)
        problem = _shape_problem(body)
        if problem:
            await error_response(bad_request(problem))(scope, receive, send)
            return
        await self.app(scope, _replay(body, last, receive), send)


def _shape_problem(body: bytes) -> str | None:
    if body and not _is_utf8(body):  # json.loads(bytes) would take UTF-16 and -32, which the count misreads
        return "the request body is not valid JSON: JSON text is UTF-8"
    return too_many_message() if too_many_containers(body) else None


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def _read_body(receive: Receive) -> tuple[bytes, Message]:
    """The whole body, and the message that ended it (a disconnect ends it early)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return b"".join(chunks), message


def _replay(body: bytes, last: Message, receive: Receive) -> Receive:
    """The body again, in one message; then the connection's own messages (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    if last["type"] == "http.disconnect":
        pending.append(last)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
