"""`SseRelay`: passes the engine's Server-Sent Events through while reading their `usage`."""

from __future__ import annotations

import json
from typing import Any

EVENT_END = b"\n\n"


class SseRelay:
    """Events are forwarded as soon as they are complete; only a partial event waits for the
    rest of itself. The usage-only chunk the gateway asked for on the client's behalf is dropped.
    """

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip_usage_chunk = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self.events = 0
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(EVENT_END)
        if cut < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: cut + 2], data[cut + 2 :]
        return self._filter(complete)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._filter(rest) if rest else b""

    def _filter(self, block: bytes) -> bytes:
        self.events += block.count(EVENT_END)
        if not _mentions_usage(block):  # the common case: no parsing at all
            return block
        kept = [event for event in block.split(EVENT_END) if self._keep(event)]
        return EVENT_END.join(kept)

    def _keep(self, event: bytes) -> bool:
        if not event.startswith(b"data: {") or not _mentions_usage(event):
            return True
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return True
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
        return not (self.strip_usage_chunk and payload.get("choices") == [])


def _mentions_usage(data: bytes) -> bool:
    """A non-null `usage` somewhere in `data` (servers send `"usage":null` on every chunk)."""
    total = data.count(b'"usage"')
    return total > data.count(b'"usage":null') + data.count(b'"usage": null')
