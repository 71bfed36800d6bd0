"""Incremental detokenization: text deltas from a stream of token ids, for the API server.

A byte-level tokenizer may split one UTF-8 character across tokens, so the text of a token
alone can end in U+FFFD until the next token completes it; such text is held back. Stop
strings are matched on text, not tokens, so they may span tokens; while streaming, any tail of
the text that could still grow into a stop string is held back too, so a client never sees
text that is later cut. Concatenated deltas equal `tokenizer.decode(all ids)` (without stop
strings), which is what the offline `LLM` returns.

Stop strings are checked at a cost proportional to the new text, never to the output so far
or to the square of a stop string's length (100 stop strings of 3,000 characters once made
each token cost seconds): a match is looked for only in the new text and the longest stop
string's length before it, and what to hold back is tracked by a KMP automaton per stop string.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, as vLLM does


def decode_after(tokenizer, context: Sequence[int], token_ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text of `token_ids` as it reads after `context` (see `IncrementalDetokenizer`), in one go."""
    context = list(context[-CONTEXT_TOKENS:])
    if not context:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    before = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(context + list(token_ids), skip_special_tokens=skip_special_tokens)[len(before) :]


def _decoder(tokenizer, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """`tokenizer.decode`, or straight to the Rust tokenizer behind a fast one when that gives
    the same text (no clean-up pass): this runs twice per token per stream, on the event loop,
    and transformers' wrapper costs several times the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _failure(s: str) -> list[int]:
    """KMP's failure function: entry i is the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    """A request's stop strings, prepared once and shared by all its choices (read-only)."""

    def __init__(self, stop: Sequence[str] = ()):
        self.strings = tuple(s for s in stop if s)
        self._fail = [_failure(s) for s in self.strings]

    def __bool__(self) -> bool:
        return bool(self.strings)

    def advance(self, states: list[int], new_text: str) -> None:
        """Feed new text to one choice's automata: afterwards `states[i]` is the length of the
        longest proper prefix of stop string i that the whole text ends with."""
        for i, s in enumerate(self.strings):
            fail, k = self._fail[i], states[i]
            for c in new_text:
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):  # a whole match: keep its longest proper border
                    k = fail[k - 1]
            states[i] = k

    def first_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The earliest stop string that ends after `new_from`: (where it starts, which)."""
        best: tuple[int, str] | None = None
        for s in self.strings:
            i = text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best


class IncrementalDetokenizer:
    """One choice's text as its tokens arrive. Not thread-safe; one consumer per instance."""

    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | StopStrings = (),
        include_stop_str_in_output: bool = False,
        context: Sequence[int] = (),
    ):
        """`context`: the last few prompt tokens. SentencePiece-style tokenizers drop the leading
        space of the first token decoded alone ("▁x" -> "x"); decoded after its context, an
        output's first word keeps the space it has in the whole text."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self.stops = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._stop_states = [0] * len(self.stops.strings)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = list(context[-CONTEXT_TOKENS:])
        self.text = ""  # everything decoded so far, cut at a stop string once one matched
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        # Decoding a window [prefix, end) and subtracting [prefix, read) gives the new text
        # without re-decoding from the start; `prefix` always sits on a character boundary.
        self._prefix = 0
        self._read = len(self.token_ids)
        self._released = 0  # characters of `text` already handed out

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], *, final: bool = False, match_stop: bool = True) -> str:
        """Add tokens; return the text that is now safe to show. With `final`, the choice has
        ended: nothing is held back any more. Without `match_stop` (before min_tokens, as in
        vLLM) stop strings in the new text are not looked for. Tokens after a match are ignored."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        old_len = len(self.text)
        new_text = self._decode_new(final)
        self.text += new_text
        if self.stops and match_stop:
            self._match_stop(old_len)
        if self.stops and not (final or self.stopped):
            self.stops.advance(self._stop_states, new_text)
        end = len(self.text) if (final or self.stopped) else len(self.text) - max(self._stop_states, default=0)
        delta = self.text[self._released : end]
        self._released = max(end, self._released)
        return delta

    def _decode_new(self, final: bool) -> str:
        done = self._decode(self.token_ids[self._prefix : self._read])
        window = self._decode(self.token_ids[self._prefix :])
        if len(window) <= len(done) or (window.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new yet, or a character still waiting for its next bytes
        self._prefix, self._read = self._read, len(self.token_ids)
        return window[len(done) :]

    def _match_stop(self, old_len: int) -> None:
        """Cut the text at the earliest stop string that ends in the newly decoded part."""
        match = self.stops.first_match(self.text, old_len)
        if match is not None:
            i, s = match
            self.stop_reason = s
            self.text = self.text[: i + len(s) if self.include_stop_str_in_output else i]
