"""What structured output may cost the server's memory (issue 29, finding 5): xgrammar's compiler
keeps every grammar it compiled, so unique specs grew the engine by +480 MB (5 requests of 256
choices x 410 characters), never returned. Its cache is bounded in bytes."""
from __future__ import annotations

import random
import string

import pytest
from transformers import AutoTokenizer

from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.core.structured_output import GRAMMAR_CACHE_BYTES, GrammarCompiler
from portcullis.engine.errors import RequestError
from portcullis.engine.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def _unique_choices(rng: random.Random) -> StructuredOutputsParams:
    # Random letters share no prefixes, so each grammar is big for its text (~0.5 MB for 2,048 characters).
    return StructuredOutputsParams(choice=["".join(rng.choices(string.ascii_letters, k=32)) for _ in range(64)])


def test_the_compiler_cache_stays_under_its_byte_limit_however_many_grammars_compile(tokenizer):
    limit = 4 << 20
    compiler = GrammarCompiler(tokenizer, 4096, cache_limit_bytes=limit)
    rng, largest = random.Random(0), 0
    for _ in range(64):  # about 32 MB of grammars: eight times the limit
        compiled = compiler.compile(_unique_choices(rng))
        largest = max(largest, compiler.cache_size_bytes)
    assert compiled.memory_size_bytes * 64 > 4 * limit  # the cache did have to let grammars go
    assert 0 < largest <= limit


def test_the_servers_compiler_is_bounded_by_default(tokenizer):
    compiler = GrammarCompiler(tokenizer, 4096)
    assert compiler.cache_limit_bytes == GRAMMAR_CACHE_BYTES > 0
    spec = _unique_choices(random.Random(1))
    first = compiler.compile(spec)
    assert compiler.cache_size_bytes >= first.memory_size_bytes  # what repeats is still compiled once


@pytest.mark.parametrize("spec", [StructuredOutputsParams(regex="([a-z"), StructuredOutputsParams(grammar="root ::= ("),
                                  StructuredOutputsParams(json={"type": "nonsense-type"})])
def test_a_grammar_its_parser_refuses_is_the_clients_fault(tokenizer, spec):
    with pytest.raises(RequestError, match="for structured output"):
        GrammarCompiler(tokenizer, 4096).compile(spec)


def test_an_error_of_ours_while_compiling_is_not_reported_as_the_clients(tokenizer, monkeypatch):
    compiler = GrammarCompiler(tokenizer, 4096)

    def broken(*args, **kwargs):
        raise TypeError("a bug of ours")

    monkeypatch.setattr(compiler._compiler, "compile_regex", broken)
    with pytest.raises(TypeError):
        compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
