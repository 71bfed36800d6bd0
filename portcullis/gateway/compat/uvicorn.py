"""uvicorn's h11 protocol, which `gateway.connection`'s guards subclass (head and body deadlines,
a send deadline, the concurrency cap answered with an OpenAI body). What the subclass relies
on of it, beyond its public constructor, is listed here and pinned by tests/gateway/test_compat.py."""
from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

# Set by H11Protocol.__init__ / connection_made and read or replaced by the guards.
ATTRIBUTES = ("app", "conn", "limit_concurrency", "loop", "connections", "tasks", "app_state",
              "timeout_keep_alive", "timeout_keep_alive_task")
# Called through super() or overridden.
METHODS = ("connection_made", "connection_lost", "data_received", "on_response_complete", "pause_writing",
           "resume_writing", "timeout_keep_alive_handler")

__all__ = ["ATTRIBUTES", "H11Protocol", "METHODS"]
