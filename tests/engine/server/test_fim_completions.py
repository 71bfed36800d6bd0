"""Fill-in-the-middle end to end: `client.completions.create(prompt=..., suffix=...)` over a real
socket, on a random-weight qwen2 whose tokenizer has Qwen2.5-Coder's FIM tokens, and refused on
a model without them."""
from __future__ import annotations

import openai
import pytest

from portcullis.engine.server import fim
from tests.engine.server.conftest import start_server
from tests.support.openai_errors import assert_error

NAME = "tiny-coder"
GREEDY = dict(model=NAME, temperature=0)
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return total\n"


@pytest.fixture(scope="module")
def fim_server(fim_model, tmp_path_factory):
    running = start_server(fim_model, tmp_path_factory.mktemp("fim"), name=NAME)
    yield running
    running.stop()


@pytest.fixture
def fim_client(fim_server) -> openai.OpenAI:
    return fim_server.client()


def fim_ids(tokenizer, prefix: str, suffix: str) -> list[int]:
    """The prompt as Qwen2.5-Coder's model card writes it, markers parsed as special tokens."""
    return tokenizer.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>")


def test_suffix_runs_the_fim_prompt(fim_server, fim_client):
    tok = fim_server.state.tokenizer
    ids = fim_ids(tok, PREFIX, SUFFIX)
    ends = list(fim.detect(tok).end_ids)
    for extra in ({}, {"ignore_eos": True}):  # this random model soon picks an end token; ignore_eos runs on
        out = fim_client.completions.create(prompt=PREFIX, suffix=SUFFIX, max_tokens=8, extra_body=extra, **GREEDY)
        assert out.usage.prompt_tokens == len(ids)
        # The same tokens as a plain prompt, FIM's end tokens as stops unless ignore_eos: the same middle.
        stops = {} if extra else {"stop_token_ids": ends}
        same = fim_client.completions.create(prompt=ids, max_tokens=8, extra_body={**extra, **stops}, **GREEDY)
        assert out.choices[0].text == same.choices[0].text
        assert out.choices[0].finish_reason == same.choices[0].finish_reason
        assert out.usage.completion_tokens == same.usage.completion_tokens
    assert out.usage.completion_tokens == 8 and out.choices[0].text


def test_streamed_middle_equals_the_plain_one(fim_client):
    kw = dict(prompt=PREFIX, suffix=SUFFIX, max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    plain = fim_client.completions.create(**kw)
    chunks = list(fim_client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.text for chunk in chunks for c in chunk.choices)
    reasons = [c.finish_reason for chunk in chunks for c in chunk.choices]
    assert text == plain.choices[0].text and reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_a_fim_end_token_stops_and_is_not_shown(fim_server, fim_client, stream):
    pad = fim_server.state.tokenizer.convert_tokens_to_ids("<|fim_pad|>")
    kw = dict(prompt=PREFIX, suffix=SUFFIX, max_tokens=12, logit_bias={str(pad): 100}, **GREEDY,
              extra_body={"min_tokens": 2, "skip_special_tokens": False})
    if stream:
        chunks = [c for chunk in fim_client.completions.create(stream=True, **kw) for c in chunk.choices]
        text, last = "".join(c.text for c in chunks), chunks[-1]
    else:
        out = fim_client.completions.create(**kw)
        (last,), text = out.choices, out.choices[0].text
        assert out.usage.completion_tokens == 3  # two tokens, then <|fim_pad|>
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == pad
    assert "<|fim_pad|>" not in text


def test_ignore_eos_runs_past_fim_end_tokens(fim_server, fim_client):
    pad = fim_server.state.tokenizer.convert_tokens_to_ids("<|fim_pad|>")
    out = fim_client.completions.create(prompt=PREFIX, suffix=SUFFIX, max_tokens=4, logit_bias={str(pad): 100},
                                        extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


def test_echo_shows_the_prefix_not_the_scaffolding(fim_client):
    kw = dict(prompt=PREFIX, suffix=SUFFIX, max_tokens=4, echo=True, extra_body={"ignore_eos": True}, **GREEDY)
    out = fim_client.completions.create(**kw)
    middle = fim_client.completions.create(**{**kw, "echo": False}).choices[0].text
    assert out.choices[0].text == PREFIX + middle
    chunks = [c for chunk in fim_client.completions.create(stream=True, **kw) for c in chunk.choices]
    assert chunks[0].text == PREFIX and "".join(c.text for c in chunks) == PREFIX + middle


def test_a_shared_prefix_is_served_from_the_prefix_cache(fim_server, fim_client):
    tok = fim_server.state.tokenizer
    prefix = "".join(f"def handler_{i}(event):\n    return event.get('k{i}')\n\n" for i in range(8))
    shared = 1 + len(tok.encode(prefix))  # <|fim_prefix|> and the prefix
    assert shared >= 64
    block = fim_server.core.config.block_size
    first = fim_client.completions.create(prompt=prefix, suffix="\nprint(1)\n", max_tokens=2, **GREEDY)
    second = fim_client.completions.create(prompt=prefix, suffix="\nprint(2)\n", max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == shared // block * block


def test_each_prompt_of_a_list_gets_the_suffix(fim_server, fim_client):
    tok = fim_server.state.tokenizer
    prefixes = ["x = 1\n", "y = 2\n"]
    out = fim_client.completions.create(prompt=prefixes, suffix=SUFFIX, max_tokens=3, **GREEDY)
    assert len(out.choices) == 2
    assert out.usage.prompt_tokens == sum(len(fim_ids(tok, p, SUFFIX)) for p in prefixes)
    by_ids = fim_client.completions.create(prompt=[tok.encode(p) for p in prefixes], suffix=SUFFIX, max_tokens=3,
                                           **GREEDY)
    assert [c.text for c in by_ids.choices] == [c.text for c in out.choices]


def test_the_context_check_counts_the_whole_fim_prompt(fim_server):
    with fim_server.http() as http:
        body = {"model": NAME, "prompt": "a", "suffix": " b" * 600, "max_tokens": 4}
        assert_error(http.post("/v1/completions", json=body), 400, param="prompt", says=("maximum context length",))
        body = {"model": NAME, "prompt": " a" * 250, "suffix": " b" * 250, "max_tokens": 100}
        assert_error(http.post("/v1/completions", json=body), 400, param="max_tokens")
        assert http.post("/v1/completions", json={**body, "max_tokens": 2, "truncate_prompt_tokens": 300}).status_code == 200


def test_suffix_on_a_model_without_fim_tokens_is_a_400(server):
    with server.http() as http:
        body = {"model": "tiny-llama", "prompt": "def f():", "suffix": "\n    return 1", "max_tokens": 2}
        assert_error(http.post("/v1/completions", json=body), 400, param="suffix", says=("FIM tokens",))
        stream = http.post("/v1/completions", json={**body, "stream": True})
        assert_error(stream, 400, param="suffix")
        del body["suffix"]
        assert http.post("/v1/completions", json=body).status_code == 200  # still serving
