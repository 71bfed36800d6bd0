"""The gateway's HTTP/1.1 connections: uvicorn's h11 protocol with the limits it lacks.

uvicorn bounds the size of a request head (h11's `max_incomplete_event_size`) and the idle
time between requests (`timeout_keep_alive`), but not how long a client may take to send a
head or a body, nor how long a response may wait for a client that does not read: a client
sending one byte every few seconds would hold its connection, and what it sent, for ever.
Here each connection runs one timer for what it waits on (head, body) and one while its
writes are paused, and refusals carry OpenAI's error body instead of uvicorn's plain text.

Every refusal is audited. One made while the application runs the request (a body that came
too slowly) is left in the request's scope under `REFUSED_KEY`, so the application's own
audit line gives the status the client was told; one made before any application ran (a slow
or oversized head, bytes that are not HTTP, the concurrency limit) goes to the callable the
application's lifespan put in its state under `REFUSAL_HOOK`.

Under TLS (gateway.tls) the same protocol runs inside asyncio's TLS layer; a client
certificate that verified against --ssl-ca-certs has its names put in each request's scope
under `CLIENT_CERT_KEY`, for authentication (gateway.auth.certs).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import structlog

from portcullis.gateway.compat.uvicorn import H11Protocol
from portcullis.gateway.errors import error_body
from portcullis.gateway.tls import CLIENT_CERT_KEY, client_cert_names

log = structlog.get_logger("portcullis.gateway.connection")

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


REFUSAL_HOOK = "portcullis.connection_refused"  # in the lifespan state: (status, code, client, method, path)
REFUSED_KEY = "portcullis.connection_refused"  # in a running request's scope: (status, message, code)
RefusalHook = Callable[[int, str, str, str, str], None]


# While writes are paused, a client must take at least this much of the response in each
# --timeout-send (about 2 KiB/s at the default 30 s): a large answer on a slow link is
# written as one block and stays "paused" until nearly all of it has gone.
MIN_PROGRESS_BYTES = 64 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    timeout_header_s: float  # from a new connection, or a request's first byte, to its whole head
    timeout_body_s: float  # from the head to the end of the body
    timeout_send_s: float  # longest a response may wait for the client to read
    limit_concurrency: int  # connections or requests in flight; more are answered 503
    max_header_bytes: int  # only for the 431's message: h11 enforces it


def error_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with OpenAI's error body."""
    body = error_body(status, message, code)
    head = (f"HTTP/1.1 {status} ".encode() + REASONS[status] + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
    return head + body


class _Connection(h11.Connection):
    """Remembers why the client's bytes were refused, for the status of the answer."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise


class GuardedH11Protocol(H11Protocol):
    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.conn = _Connection(h11.SERVER, limits.max_header_bytes)
        self.limit_concurrency = None  # checked in _admit, to answer with an OpenAI body
        self._app, self.app = self.app, self._admit
        self._waiting_for: str | None = None  # "head" or "body"
        self._read_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the transport when the send timer was armed
        self._client_cert: tuple[str, ...] = ()  # a verified TLS client certificate's names (mTLS)

    # -- reading: one deadline for the head, one for the body ---------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._client_cert = client_cert_names(transport.get_extra_info("peercert"))
        self._expect("head", self.limits.timeout_header_s)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._waiting_for is None:
            # The first byte of a request on a kept-alive connection starts its head's clock.
            self._expect("head", self.limits.timeout_header_s)
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a pipelined request may have been read meanwhile

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._expect("body", self.limits.timeout_body_s)
        elif state is not h11.IDLE or self._waiting_for != "head":
            self._expect(None, 0)
            if state is h11.IDLE:
                self._idle()

    def _idle(self) -> None:
        """Between requests the keep-alive timer must run. uvicorn arms it when a response
        ends, but a body that ends after its answer (a request refused before its body was
        read) cancels it for good: such connections would stay open and pile up."""
        if self.timeout_keep_alive_task is None and (self.cycle is None or self.cycle.response_complete):
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _expect(self, what: str | None, timeout_s: float) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._waiting_for, self._read_timer = what, None
        if what is not None:
            self._read_timer = self.loop.call_later(timeout_s, self._read_timed_out, what)

    def _read_timed_out(self, what: str) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if what == "body" and self.cycle is not None and self.cycle.response_complete:
            self.transport.close()  # answered (and audited) before its body came: nothing to add
            return
        log.info("client_too_slow", phase=what, client=self.client and self.client[0])
        if what == "head" and not self.conn.trailing_data[0]:
            self.transport.close()  # connected and said nothing: nothing to answer
            return
        limit = self.limits.timeout_header_s if what == "head" else self.limits.timeout_body_s
        self._refuse(408, f"The request {what} did not arrive within {limit:g} s; send the whole request at once.",
                     f"{what}_timeout")

    # -- writing: a client that stops reading is cut off -------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._watch_sending()

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()

    def _watch_sending(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.limits.timeout_send_s, self._send_timed_out)

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if self._unsent - self.transport.get_write_buffer_size() >= MIN_PROGRESS_BYTES:
            self._watch_sending()  # a slow link, not a client that stopped reading
            return
        log.info("client_too_slow", phase="response", client=self.client and self.client[0])
        # A reset, not a close: a close would leave the unsent response in the kernel, still
        # trickling out to this client, and abort() alone only drops asyncio's copy of it.
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None, 0)
        self._cancel_send_timer()
        super().connection_lost(exc)

    # -- refusals ---------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        error = self.conn.last_error
        if error is not None and error.error_status_hint == 431:
            self._refuse(431, f"The request head is larger than {self.limits.max_header_bytes} bytes; "
                         "send fewer or shorter headers.", "request_header_too_large")
        else:
            self._refuse(400, "The request is not valid HTTP/1.1.", "invalid_http")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer and close; the application, if it is running, sees a disconnect. Once its
        own response has begun, nothing can be added to it: the connection is only closed."""
        response = error_bytes(status, message, code)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                response = b""
            cycle.scope[REFUSED_KEY] = (status, message, code)  # the application audits it
            cycle.disconnected = True
            cycle.message_event.set()
        else:
            self._audit(status, code, "-", "-")
        self.transport.write(response)
        self.transport.close()

    def _audit(self, status: int, code: str, method: str, path: str) -> None:
        hook: RefusalHook | None = self.app_state.get(REFUSAL_HOOK)
        if hook is not None:
            hook(status, code, self.client[0] if self.client else "-", method, path)

    async def _admit(self, scope: Any, receive: Any, send: Any) -> None:
        # This request's task and connection are already counted (uvicorn checks before adding).
        limit = self.limits.limit_concurrency
        if scope["type"] == "http" and (len(self.connections) > limit or len(self.tasks) > limit):
            log.warning("concurrency_limit_reached", limit=limit)
            self._audit(503, "gateway_overloaded", scope["method"], scope.get("raw_path", b"").decode("latin-1"))
            body = error_body(503, "The gateway is at its concurrency limit; retry shortly.", "gateway_overloaded")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"retry-after", b"1"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        if self._client_cert:
            scope[CLIENT_CERT_KEY] = self._client_cert  # read by authentication (gateway.auth.resolve)
        await self._app(scope, receive, send)
