"""Logprobs in the shapes clients expect: OpenAI's legacy completions object, its chat
`content` list, and vLLM's `prompt_logprobs`, from the engine's `TokenLogprobs`."""
from __future__ import annotations

import math
from collections.abc import Sequence

_FLOOR = -9999.0  # -inf is not JSON; vLLM reports this instead


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else _FLOOR


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Each token's text and raw bytes (a byte-level token may be part of a UTF-8 character,
    which only its bytes show), cached: the vocabulary bounds the cache."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._bytes_of = _byte_decoder() if type(decoder).__name__ == "ByteLevel" else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            hit = self._cache[token_id] = (text, self._raw_bytes(token_id, text))
        return hit

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        if self._bytes_of is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece and all(c in self._bytes_of for c in piece):
                return [self._bytes_of[c] for c in piece]
        return list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence, text_of: TokenText, top_n: int) -> dict:
    """`{"content": [{token, logprob, bytes, top_logprobs}]}` for chat completions."""
    content = []
    for e in entries:
        token, raw = text_of(e.token_id)
        top = [_chat_alt(text_of, tid, lp) for tid, lp in e.top[:top_n]]
        content.append({"token": token, "logprob": _finite(e.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content}


def _chat_alt(text_of: TokenText, token_id: int, lp: float) -> dict:
    token, raw = text_of(token_id)
    return {"token": token, "logprob": _finite(lp), "bytes": raw}


def completion_logprobs(entries: Sequence, token_ids: Sequence[int], text_of: TokenText, offset: int) -> dict:
    """OpenAI's legacy `{tokens, token_logprobs, top_logprobs, text_offset}`. `entries[i]` is for
    `token_ids[i]` and may be None (a prompt's first token has no logprob); `offset` is where
    the first token's text starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, e in zip(token_ids, entries):
        token, _ = text_of(tid)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(e.logprob))
        top = {text_of(t)[0]: _finite(lp) for t, lp in e.top}
        top.setdefault(token, _finite(e.logprob))  # the chosen token is always listed, as in vLLM
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs(entries: Sequence, text_of: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None or {id: {logprob, rank, decoded_token}}."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        alts = {str(t): {"logprob": _finite(lp), "rank": r + 1, "decoded_token": text_of(t)[0]}
                for r, (t, lp) in enumerate(e.top)}
        alts[str(e.token_id)] = {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": text_of(e.token_id)[0]}
        out.append(alts)
    return out
