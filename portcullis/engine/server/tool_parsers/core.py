"""The streaming core every tool-call format shares.

A reply is content until a format's marker opens a *block* of calls (`<tool_call>`,
`[TOOL_CALLS]`, ...). A block holds one JSON value: a call `{"name": ..., "arguments": {...}}` or
a list of them. While a block streams, each call is sent as OpenAI's deltas: first its index, id,
type and name (once the name is complete and names a given function), then its arguments as JSON
fragments, in order, as they are generated. Partial JSON is read with `partial-json-parser`; the
arguments sent are `json.dumps` of what has been parsed, up to what can no longer change, so the
fragments of a call always join into `json.dumps` of its final arguments.

A block that is not a call of a given function (bad JSON, no name, an unknown name) turns the
parser off before any of its calls was sent: its text, and everything after it, is content. Text
held back at the end of a feed (a possible start of a marker) waits for the next feed, so the
deltas do not depend on how the text was split: joined, they equal `extract` of the whole reply.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import partial_json_parser
from partial_json_parser.core.options import Allow

# Partial strings, objects and arrays; numbers and literals only once complete (a partial number
# such as `1.5e` re-encodes to something the final value does not start with).
_ARGUMENT_PARTS = Allow.STR | Allow.OBJ | Allow.ARR
_NAME_PARTS = Allow.OBJ | Allow.ARR  # no partial strings: a name that is there is complete
_DECODER = json.JSONDecoder(strict=False)  # a raw tab in a string is not worth refusing a call for
LONG_BLOCK = 1024  # characters of an open block beyond which it is not parsed again at every feed
_HIGH_SURROGATES = "".join(chr(c) for c in range(0xD800, 0xDC00))
_SURROGATE = re.compile("[\ud800-\udfff]")


def _loads(text: str):
    return _DECODER.decode(text)


def _first_value(text: str):
    """The JSON value `text` starts with (after whitespace); what follows it is ignored."""
    return _DECODER.raw_decode(text, len(text) - len(text.lstrip()))[0]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-k:]):
                longest = k
                break
    return longest


def arguments_json(value) -> str:
    """A call's arguments as OpenAI sends them: a JSON text (an object when the model wrote one)."""
    if value is None:
        return "{}"
    return _escape_surrogates(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def _escape_surrogates(text: str) -> str:
    """A lone surrogate (the model wrote half of a `\ud83d\ude00` pair) cannot be sent as UTF-8:
    it goes as its JSON escape instead."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _settled(partial_arguments: dict) -> str:
    """The start of `json.dumps(arguments)` that more text can no longer change: without the
    quotes and brackets that the partial parse closed (and a high surrogate whose pair may follow)."""
    text = json.dumps(partial_arguments, ensure_ascii=False).rstrip('"]}').rstrip(_HIGH_SURROGATES)
    return _escape_surrogates(text)


@dataclass
class Call:
    index: int
    name: str
    id: str = field(default_factory=new_call_id)
    sent: str = ""  # arguments sent so far


@dataclass
class Extracted:
    """A whole reply: its content (None when it is only calls) and its calls, as OpenAI's message has them."""

    content: str | None
    tool_calls: list[dict]


class _Malformed(Exception):
    pass


class ToolParser:
    """Splits a reply into content and tool calls. `feed` takes each new piece of text and returns
    OpenAI delta dicts (`{"content": ...}` or `{"tool_calls": [...]}`); `finish` ends the reply.
    Subclasses name their markers and, where it differs, how a block ends."""

    name = ""
    markers: tuple[str, ...] = ()  # texts that open a block of calls
    special_tokens = False  # True when the markers are special tokens, dropped unless kept on decode

    def __init__(self, tools=None):
        self.tools = frozenset(tools) if tools is not None else None  # None: any name is a call
        self.calls: list[Call] = []
        self._buf = ""  # text not yet settled: a held tail outside a block, the block so far inside
        self._opener: str | None = None  # the text that opened the current block (None: outside one)
        self._block: list[Call | None] = []  # the current block's calls (None: a skipped entry)
        self._off = False  # the reply proved not to be calls: all that follows is content
        self._space = ""  # whitespace after a call, shown only if more content follows it
        self._parsed = 0  # how much of the open block was read last time
        self._out: list[dict] = []

    # -- the interface ------------------------------------------------------------------------

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        self._advance(final=True)
        if self._buf:
            self._content(self._buf)
            self._buf = ""
        return self._take()

    def extract(self, text: str) -> Extracted:
        """A whole reply at once, on a parser that has not been fed yet."""
        return merge(self.feed(text) + self.finish())

    # -- format hooks ---------------------------------------------------------------------------

    def _find_block(self, text: str) -> tuple[int, int] | None:
        """Where the first block in `text` starts: (its marker's start, its body's start)."""
        found = [(i, i + len(m)) for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def _held(self, text: str) -> int:
        """How much of the end of `text` (outside a block) must wait for more text."""
        return held_marker_length(text, self.markers)

    def _block_end(self, body: str, final: bool) -> tuple[str, int] | None:
        """Once the block is over: its JSON text and where what follows it starts. By default a
        block is one JSON value, over when it parses."""
        start = len(body) - len(body.lstrip())
        if start == len(body):
            return ("", len(body)) if final else None
        try:
            _, end = _DECODER.raw_decode(body, start)
        except (ValueError, RecursionError):
            return (body, len(body)) if final else None
        return body[:end], end

    def _partial_text(self, body: str) -> str:
        """The part of an open block to read as partial JSON."""
        return body

    # -- the machine ------------------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        while self._buf and not self._off:
            if self._opener is None:
                if not self._outside(final):
                    return
            elif not self._inside(final):
                return
        if self._off and self._buf:
            self._content(self._buf)
            self._buf = ""

    def _outside(self, final: bool) -> bool:
        """Content up to the next block; True when a block opened."""
        found = self._find_block(self._buf)
        if found is None:
            keep = 0 if final else self._held(self._buf)
            self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        start, body = found
        self._content(self._buf[:start])
        self._space = ""
        self._opener, self._buf, self._block, self._parsed = self._buf[start:body], self._buf[body:], [], 0
        return True

    def _inside(self, final: bool) -> bool:
        """Stream the open block; True when it ended."""
        if not final and not self._due(len(self._buf)):
            return False
        end = self._block_end(self._buf, final)
        text = end[0] if end is not None else self._partial_text(self._buf)
        self._parsed = len(self._buf)
        if text.strip():
            try:
                self._stream_block(text, complete=end is not None)
            except (_Malformed, RecursionError):  # RecursionError: arguments nested too deep to encode
                if not any(self._block):  # nothing of it was sent: it was text after all
                    self._turn_off()
                    return False
        if end is None:
            return False
        if not any(self._block):  # it ended with no call in it
            self._turn_off()
            return False
        self._opener, self._buf = None, self._buf[end[1] :]
        self._block_ended()
        return True

    def _block_ended(self) -> None:
        """Called after each block (a format may expect another one right after it)."""

    def _due(self, size: int) -> bool:
        """Whether an open block is worth reading again. Each reading parses it all, so a long
        one (a file's content as an argument) is read as it grows by a 32nd, not at every token:
        linear time in all, in pieces of at most a 32nd of the text (its end is seen as late)."""
        return size <= LONG_BLOCK or size - self._parsed >= size // 32

    def _turn_off(self) -> None:
        self._off = True
        self._buf = self._opener + self._buf
        self._opener = None

    def _stream_block(self, text: str, complete: bool) -> None:
        if complete:
            try:
                entries = named = _entries(_first_value(text))
            except (ValueError, RecursionError):
                complete = False  # cut short (max_tokens): read what there is, as while it streamed
        if not complete:
            entries = named = _entries(_partial(text, _ARGUMENT_PARTS))
            if len(self._block) < len(entries):  # a call still waits for its name
                named = _entries(_partial(text, _NAME_PARTS))
        for j, entry in enumerate(entries):
            if j == len(self._block) and not self._admit(named[j] if j < len(named) else {}, complete):
                return
            call = self._block[j]
            if call is not None:
                self._send_arguments(call, entry, complete)

    def _admit(self, entry, complete: bool) -> bool:
        """Start the block's next call once its name is known; False to wait for more text."""
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            if complete or not isinstance(entry, dict):
                self._reject()
            return complete  # complete: the entry is skipped, later ones may still be calls
        if self.tools is not None and name not in self.tools:
            self._reject()
            return True
        call = Call(len(self.calls), name)
        self.calls.append(call)
        self._block.append(call)
        self._out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})
        return True

    def _reject(self) -> None:
        """An entry that is not a call: the block is text if nothing of it was sent, else it is skipped."""
        if not any(self._block):
            raise _Malformed
        self._block.append(None)

    def _send_arguments(self, call: Call, entry, complete: bool) -> None:
        if not isinstance(entry, dict):
            return
        value = entry.get("arguments", entry.get("parameters"))
        if complete:
            text = arguments_json(value)
        elif isinstance(value, dict):
            text = _settled(value)
        else:
            return
        # Only a JSON object with a key twice can make the final text not extend what was sent;
        # what was sent cannot be taken back, so the rest is then left out.
        if len(text) > len(call.sent) and text.startswith(call.sent):
            self._arguments(call, text[len(call.sent) :])
            call.sent = text

    # -- output -----------------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if self.calls and not self._off:  # after a call, whitespace counts only if more text follows
            text = self._space + text
            kept = text.rstrip()
            text, self._space = kept, text[len(kept) :]
        if text:
            self._out.append({"content": text})

    def _arguments(self, call: Call, fragment: str) -> None:
        self._out.append({"tool_calls": [{"index": call.index, "function": {"arguments": fragment}}]})

    def _take(self) -> list[dict]:
        out, self._out = compact_deltas(self._out), []
        return out


def _partial(text: str, allow: Allow):
    try:
        return partial_json_parser.loads(text, allow, parser=_loads)
    except Exception as exc:  # noqa: BLE001 - on text that is not JSON it raises IndexError and others too
        raise _Malformed from exc


def _entries(value) -> list:
    return value if isinstance(value, list) else [value]


def compact_deltas(deltas: list[dict]) -> list[dict]:
    """Adjacent deltas of the same kind as one: content with content, a call's pieces together."""
    out: list[dict] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and set(d) == set(last) and len(d) == 1:
            key = next(iter(d))
            if key != "tool_calls":
                out[-1] = {key: last[key] + d[key]}
                continue
            prev, new = last["tool_calls"][-1], d["tool_calls"][0]
            if prev["index"] == new["index"]:
                fn = {**prev["function"], "arguments": prev["function"].get("arguments", "") + new["function"]["arguments"]}
                out[-1] = {"tool_calls": [{**prev, "function": fn}]}
                continue
        out.append(d)
    return out


def merge(deltas: list[dict]) -> Extracted:
    """Deltas joined into a whole reply's content and calls."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                  "function": {"name": tc["function"].get("name"), "arguments": ""}})
            call["function"]["arguments"] += tc["function"].get("arguments", "")
    return Extracted(content if content or not calls else None, [calls[i] for i in sorted(calls)])
