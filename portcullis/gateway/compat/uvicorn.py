"""uvicorn's h11 protocol, which `gateway.connection`'s guards subclass (head and body deadlines,
a send deadline, the concurrency cap answered with an OpenAI body). What the subclass relies
on of it, beyond its public constructor, is listed here and pinned by tests/gateway/test_compat.py."""
from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

# Set by H11Protocol.__init__ and read or replaced by the guards; `app` is read again for each
# request, so the guards' admission check can stand in its place.
ATTRIBUTES = ("app", "conn", "limit_concurrency", "loop", "connections", "tasks", "app_state",
              "timeout_keep_alive", "timeout_keep_alive_task")
# Set by connection_made (`transport`, `client`: the peer's (host, port)) and by each request (`cycle`).
CONNECTION_ATTRIBUTES = ("transport", "client", "cycle")
# Of a request's `cycle`: read to know where its response stands, or set to end it as a disconnect
# (`disconnected`, then `message_event` set: the application's receive() answers http.disconnect).
CYCLE_ATTRIBUTES = ("scope", "response_started", "response_complete", "disconnected", "message_event")
# Called through super() or overridden (`send_400_response`: bytes that are not HTTP).
METHODS = ("connection_made", "connection_lost", "data_received", "on_response_complete", "pause_writing",
           "resume_writing", "timeout_keep_alive_handler", "send_400_response")

__all__ = ["ATTRIBUTES", "CONNECTION_ATTRIBUTES", "CYCLE_ATTRIBUTES", "H11Protocol", "METHODS"]
