"""Incremental detokenization: text deltas from a stream of token ids, for the API server.

A byte-level tokenizer may split one UTF-8 character across tokens, so the text of a token
alone can end in U+FFFD until the next token completes it; such text is held back. Stop
strings are matched on text, not tokens, so they may span tokens; while streaming, any tail of
the text that could still grow into a stop string is held back too, so a client never sees
text that is later cut. Concatenated deltas equal `tokenizer.decode(all ids)` (without stop
strings), which is what the offline `LLM` returns.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


def _decoder(tokenizer, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """`tokenizer.decode`, or straight to the Rust tokenizer behind a fast one when that gives
    the same text (no clean-up pass): this runs twice per token per stream, on the event loop,
    and transformers' wrapper costs several times the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """One choice's text as its tokens arrive. Not thread-safe; one consumer per instance."""

    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far, cut at a stop string once one matched
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        # Decoding a window [prefix, end) and subtracting [prefix, read) gives the new text
        # without re-decoding from the start; `prefix` always sits on a character boundary.
        self._prefix = 0
        self._read = 0
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
        self.text += self._decode_new(final)
        if match_stop:
            self._match_stop(old_len)
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._stop_prefix_len()
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
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stop_reason = s
            self.text = self.text[: i + len(s) if self.include_stop_str_in_output else i]

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest
