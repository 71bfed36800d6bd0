"""Structured output with xgrammar: compile a JSON Schema, any-JSON, regex, choice or EBNF grammar
into a token-level automaton whose bitmask the sampler applies to that request's row only.

Compilation is the slow part, so it happens where the request is accepted (the API side, in a
worker thread), never in the engine's step loop; results are cached by xgrammar per spec.
"""
from __future__ import annotations

import json

from engine.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = ()):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: StructuredOutputsParams):
        """A compiled grammar for `spec`; raises ValueError naming what is wrong with it."""
        kind, compile_fn = self._pick(spec)
        try:
            return compile_fn()
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with a parser message
            raise ValueError(f"invalid {kind} for structured output: {exc}") from exc

    def _pick(self, spec: StructuredOutputsParams):
        c = self._compiler
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            # Compact JSON: a small model left free to emit whitespace may never close the object.
            return "JSON schema", lambda: c.compile_json_schema(schema, any_whitespace=False)
        if spec.json_object:
            return "JSON object", c.compile_builtin_json_grammar
        if spec.regex is not None:
            return "regex", lambda: c.compile_regex(spec.regex)
        if spec.choice is not None:
            rule = " | ".join(json.dumps(choice) for choice in spec.choice)
            return "choice", lambda: c.compile_grammar(f"root ::= {rule}")
        return "grammar", lambda: c.compile_grammar(spec.grammar)


def new_matcher(compiled):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)
