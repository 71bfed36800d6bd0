"""`SseRelay`: passes the engine's Server-Sent Events through while reading their `usage` and
counting the tool calls in their deltas; `AnthropicSseRelay` does the same for the events of
Anthropic's Messages API (`message_start`, content blocks, `message_delta`, `message_stop`), and
`ResponsesSseRelay` for those of OpenAI's Responses API (`response.created` ... `response.completed`).
Each relay also writes the event that ends its stream when the engine breaks it off."""

from __future__ import annotations

import json
from typing import Any

from portcullis.gateway.errors import responses_error_event, stream_error_event

EVENT_END = b"\n\n"


class SseRelay:
    """Events are forwarded as soon as they are complete; only a partial event waits for the
    rest of itself. The usage-only chunk the gateway asked for on the client's behalf is dropped.
    Only events that mention a non-null `usage`, or start a tool call, are parsed: a text stream
    costs a few byte searches per chunk, and a call's `arguments` deltas no more than text.
    """

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip_usage_chunk = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self.prompt_tokens: int | None = None  # known before the stream's usage is (Anthropic's message_start)
        self.events = 0
        self._calls: set[tuple[Any, Any]] = set()  # (choice index, tool-call index) seen in deltas
        self._pending = b""

    @property
    def tool_calls(self) -> int:
        """Distinct tool calls streamed so far (each arrives as several deltas of one index)."""
        return len(self._calls)

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
        if not _mentions_usage(block) and not self._starts_call(block):
            return block  # the common case: no parsing at all
        kept = [event for event in block.split(EVENT_END) if self._keep(event)]
        return EVENT_END.join(kept)

    @staticmethod
    def _starts_call(data: bytes) -> bool:
        return _starts_call(data)

    def error_event(self, status: int, message: str, code: str, path: str) -> bytes:
        """The last event of a stream the engine broke off (no `[DONE]` or stop event after it)."""
        return stream_error_event(status, message, code, path)

    def _keep(self, event: bytes) -> bool:
        if not event.startswith(b"data: {"):
            return True
        usage, calls = _mentions_usage(event), _starts_call(event)
        if not usage and not calls:
            return True
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return True
        if calls:
            self._count_calls(payload.get("choices"))
        if not usage:
            return True
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
        return not (self.strip_usage_chunk and payload.get("choices") == [])

    def _count_calls(self, choices: Any) -> None:
        for choice in choices if isinstance(choices, list) else ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            for call in calls if isinstance(calls, list) else ():
                if isinstance(call, dict):
                    self._calls.add((_hashable(choice.get("index")), _hashable(call.get("index"))))


class TypedEventRelay(SseRelay):
    """A stream of typed events (`event: <type>` then `data: {"type": ...}`), relayed unchanged:
    only events that may carry usage or open a tool call are parsed, and handed to `_read`."""

    def __init__(self) -> None:
        super().__init__(strip_usage_chunk=False)
        self._tool_items = 0

    @property
    def tool_calls(self) -> int:
        return self._tool_items

    def _keep(self, event: bytes) -> bool:
        at = event.find(b"data: {")  # after the `event: <type>` line
        if at < 0 or (at > 0 and event[at - 1 : at] != b"\n"):
            return True
        try:
            payload = json.loads(event[at + 6 :])
        except ValueError:
            return True
        if isinstance(payload, dict):
            self._read(payload)
        return True

    def _read(self, payload: dict[str, Any]) -> None:
        raise NotImplementedError


class AnthropicSseRelay(TypedEventRelay):
    """Anthropic's stream: `message_start` carries the input tokens and `message_delta` the
    output tokens (the usage is whole only at the latter); each tool call opens a `tool_use`
    content block."""

    def __init__(self) -> None:
        super().__init__()
        self._cached: Any = None  # message_start's cache_read_input_tokens

    @staticmethod
    def _starts_call(data: bytes) -> bool:
        return bool(data.count(b"content_block_start") and data.count(b'"tool_use"'))

    def _read(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        if kind == "message_start":
            usage = (payload.get("message") or {}).get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
                self.prompt_tokens = usage["input_tokens"]
                self._cached = usage.get("cache_read_input_tokens")
        elif kind == "message_delta" and isinstance(payload.get("usage"), dict):
            whole = {"input_tokens": self.prompt_tokens, "cache_read_input_tokens": self._cached, **payload["usage"]}
            self.usage = openai_usage(whole)
        elif kind == "content_block_start" and (payload.get("content_block") or {}).get("type") == "tool_use":
            self._tool_items += 1


SEQUENCE_KEY = b'"sequence_number":'


class ResponsesSseRelay(TypedEventRelay):
    """The Responses API's stream: the usage comes whole in its last event, `response.completed`
    (or `response.incomplete`, a reply cut at max_output_tokens); each function call is an
    output item added. Every event is numbered (`sequence_number`): the error event that ends
    a broken stream takes the next number, as the SDKs expect."""

    def __init__(self) -> None:
        super().__init__()
        self._last_sequence = -1

    @staticmethod
    def _starts_call(data: bytes) -> bool:
        return bool(data.count(b"response.output_item.added") and data.count(b'"function_call"'))

    def _filter(self, block: bytes) -> bytes:
        # The last number in the block is its last event's: text a model wrote cannot match,
        # since a quote inside a JSON string is escaped.
        at = block.rfind(SEQUENCE_KEY)
        if at >= 0:
            digits = block[at + len(SEQUENCE_KEY) :].lstrip()[:20]
            end = next((i for i, c in enumerate(digits) if not 48 <= c <= 57), len(digits))
            self._last_sequence = int(digits[:end]) if end else self._last_sequence
        return super()._filter(block)

    def error_event(self, status: int, message: str, code: str, path: str) -> bytes:
        return responses_error_event(message, code, self._last_sequence + 1)

    def _read(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        if kind in ("response.completed", "response.incomplete"):
            self.usage = responses_usage((payload.get("response") or {}).get("usage")) or self.usage
        elif kind == "response.output_item.added" and (payload.get("item") or {}).get("type") == "function_call":
            self._tool_items += 1


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """The Responses API's usage (`input_tokens`, `output_tokens`, `input_tokens_details`) in
    the names the limits and the audit line read."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": {"cached_tokens": cached if isinstance(cached, int) else None}}


def count_function_calls(payload: dict[str, Any]) -> int:
    """Tool calls in a whole Responses API reply: its `function_call` output items."""
    output = payload.get("output")
    return sum(isinstance(i, dict) and i.get("type") == "function_call" for i in output) if isinstance(output, list) else 0


def openai_usage(usage: Any) -> dict[str, Any] | None:
    """Anthropic's usage (`input_tokens`, `output_tokens`, `cache_read_input_tokens`) in the
    names the limits and the audit line read. The engine's `input_tokens` is the whole prompt,
    its cache reads included."""
    if not isinstance(usage, dict):
        return None
    cached = usage.get("cache_read_input_tokens")
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": {"cached_tokens": cached if isinstance(cached, int) else None}}


def count_tool_uses(payload: dict[str, Any]) -> int:
    """Tool calls in a whole Anthropic message: its `tool_use` content blocks."""
    content = payload.get("content")
    return sum(isinstance(b, dict) and b.get("type") == "tool_use" for b in content) if isinstance(content, list) else 0


def count_tool_calls(payload: dict[str, Any]) -> int:
    """Tool calls in a whole (not streamed) chat reply, over all its choices."""
    choices = payload.get("choices")
    total = 0
    for choice in choices if isinstance(choices, list) else ():
        message = choice.get("message") if isinstance(choice, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        total += len(calls) if isinstance(calls, list) else 0
    return total


def _hashable(value: Any) -> Any:
    return value if isinstance(value, int | str) or value is None else repr(value)


def _mentions_usage(data: bytes) -> bool:
    """A `usage` object somewhere in `data` (servers send `"usage":null` on every chunk)."""
    return bool(data.count(b'"usage":{') or data.count(b'"usage": {'))  # count: faster than `in` here


def _starts_call(data: bytes) -> bool:
    """A tool-call delta that may be a call's first: OpenAI (and vLLM, and our engine) name the
    function once, in the first delta of each call; later ones carry only `arguments`. A quote
    inside a JSON string is escaped, so text a model wrote cannot look like the `"name"` key."""
    return bool(data.count(b'"name"') and data.count(b'"tool_calls"'))
