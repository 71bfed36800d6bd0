"""Structured output with xgrammar: compile a JSON Schema, any-JSON, regex, choice or EBNF grammar
into a token-level automaton whose bitmask the sampler applies to that request's row only.

Compilation is the slow part, so the front-end that accepts a request compiles it (`GrammarCompiler`,
in a worker thread for the server), never the engine's step loop; xgrammar caches results per spec,
up to `GRAMMAR_CACHE_BYTES` in all. Inside the engine one owner, `StructuredOutputManager`, holds
each request's matcher: it fills the step's bitmask (a `GrammarOutput` for the runner), advances
matchers with the sampled tokens and drops them when requests finish.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import time

from portcullis.engine.core.output import GrammarOutput
from portcullis.engine.errors import RequestError
from portcullis.engine.sampling_params import StructuredOutputsParams

# xgrammar's cache of compiled grammars, bounded in bytes as xgrammar counts them: unbounded (its
# default), unique specs grew the engine by 480 MB, never returned (5 lists of 256 choices x 410
# characters). Its count is far below what the process holds: at a 64 MiB bound, 35 unique
# schemas at the size cap grew the engine by 520 MB and still growing, at 16 MiB by 312 MB; at
# 8 MiB, with the allocator's free memory returned after each big compile (`_return_memory`),
# growth stays at 130 MB however many come (measured 2026-12-06, demo tokenizer, 30 schemas of
# 65,000 characters). 8 MiB still holds about 20 schemas of 100 properties: what repeats (an
# agent's tool schemas) stays compiled.
GRAMMAR_CACHE_BYTES = 8 << 20
BIG_COMPILE_S = 0.05  # a compile this long used enough scratch memory to be worth returning

# What `json_object` (OpenAI's JSON mode) promises: an object, as in vLLM. xgrammar's built-in
# JSON grammar admits any value, and a small model wrote `[0]`, which LangChain's JSON mode refuses.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = (),
                 cache_limit_bytes: int = GRAMMAR_CACHE_BYTES):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=cache_limit_bytes)

    @property
    def cache_limit_bytes(self) -> int:
        return self._compiler.cache_limit_bytes

    @property
    def cache_size_bytes(self) -> int:
        """What the compiled grammars kept for reuse take now (xgrammar's own count)."""
        return self._compiler.get_cache_size_bytes()

    def compile(self, spec: StructuredOutputsParams):
        """A compiled grammar for `spec`; raises RequestError naming what is wrong with it."""
        kind, compile_fn = self._pick(spec)
        started = time.monotonic()
        try:
            return compile_fn()
        except RuntimeError as exc:  # xgrammar's parsers refuse a bad schema, regex or grammar so;
            # anything else (a TypeError of ours) is our fault, a 500 with the request id, not a 400
            raise RequestError(f"invalid {kind} for structured output: {exc}") from exc
        finally:
            if time.monotonic() - started > BIG_COMPILE_S:
                _return_memory()

    def _pick(self, spec: StructuredOutputsParams):
        c = self._compiler
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return "JSON schema", lambda: c.compile_grammar(json_schema_grammar(schema))
        if spec.json_object:
            return "JSON object", lambda: c.compile_grammar(json_schema_grammar(JSON_OBJECT_SCHEMA))
        if spec.regex is not None:
            return "regex", lambda: c.compile_regex(spec.regex)
        if spec.choice is not None:
            rule = " | ".join(json.dumps(choice) for choice in spec.choice)
            return "choice", lambda: c.compile_grammar(f"root ::= {rule}")
        return "grammar", lambda: c.compile_grammar(spec.grammar)


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def _return_memory() -> None:
    """Give the allocator's free memory back to the system: a big compile's scratch space (70-100
    MB for a schema at the size cap) otherwise stays in the process, fragmented by what the cache
    keeps, and the engine's RSS only grows."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# xgrammar (0.2.9, its issue 800) writes a string with minLength/maxLength as a bounded run of
# `[^"\\\r\n]`, which admits raw control characters that JSON forbids (a sampled ESC made
# json.loads fail). Such strings get the JSON string's own character class instead; escapes stay
# unavailable inside them, as in xgrammar.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str) -> str:
    """xgrammar's grammar for a JSON Schema, compact (a small model left free to emit whitespace
    may never close the object), without the control characters JSON forbids in strings."""
    import xgrammar as xgr

    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


MAX_PROPOSALS = 16  # the most proposals one step verifies (SpeculativeConfig's bound): the rollback depth


class StructuredOutputManager:
    """Every constrained request's grammar matcher, from `add` to `finish`. Engine thread only."""

    def __init__(self, vocab_size: int = 0):
        self.vocab_size = vocab_size
        self._matchers: dict[str, object] = {}

    @property
    def has_requests(self) -> bool:
        return bool(self._matchers)

    def add(self, request_id: str, compiled) -> None:
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_PROPOSALS)

    def valid_prefix(self, request_id: str, proposals: list[int]) -> list[int]:
        """The leading proposals the request's grammar allows (a speculative step verifies only
        those), short of one that would end it: a position after the end has no mask to sample
        under, so the model's own draw gives the end. The matcher is left as it was."""
        matcher = self._matchers[request_id]
        accepted = 0
        for token in proposals:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                break
        keep = accepted - 1 if matcher.is_terminated() else accepted
        if accepted:
            matcher.rollback(accepted)
        return proposals[:keep]

    def bitmask(self, request_ids: list[str], proposals: dict[str, list[int]] | None = None) -> GrammarOutput | None:
        """The allowed next tokens of `request_ids` (None when there are none): one row each, and
        for a request with (grammar-valid) proposals one more per proposal, each as if the
        proposals before it were accepted."""
        if not request_ids:
            return None
        import xgrammar as xgr

        proposals = proposals or {}
        rows = [(rid, j) for rid in request_ids for j in range(len(proposals.get(rid, ())) + 1)]
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (rid, j) in enumerate(rows):
            matcher = self._matchers[rid]
            if j:
                matcher.accept_token(proposals[rid][j - 1])
            matcher.fill_next_token_bitmask(bitmask, i)
            if j and j == len(proposals[rid]):
                matcher.rollback(j)
        return GrammarOutput([rid for rid, _ in rows], bitmask, [j for _, j in rows])

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher by `token`; whether its grammar is now complete."""
        matcher = self._matchers[request_id]
        matcher.accept_token(token)
        return matcher.is_terminated()

    def finish(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
