"""`truncate_prompt_tokens` on a long text (issue 29): only the text's tail is tokenized, so a
multi-megabyte document sent to be truncated costs the tokenizer what is kept, and the tokens
kept are the whole text's last ones."""
from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.server.prompts import truncation_tail

PARAGRAPH = ("The quick brown fox jumps over the lazy dog, then naps until 5:30 p.m.; "
             "nobody knows why it chose 42 as its favourite number (or 3.14159).\n")
# Chosen before looking at any result: prose, code, JSON, numbers, CJK with its punctuation,
# emoji and accents, and whitespace runs, as users paste them.
TEXTS = {
    "prose": PARAGRAPH * 400,
    "code": "def f(x):\n    return [i * x for i in range(10)]  # comment\n\n" * 1000,
    "json": '{"id": 12345, "tags": ["a", "b"], "nested": {"ok": true, "v": -0.5}},\n' * 1000,
    "numbers": ", ".join(str(i * 7919) for i in range(10000)),
    "cjk": "我们今天去公园散步，天气很好。然后回家吃饭，晚上看书！" * 2000,
    "mixed": "Ça va? 😀 naïve café — ümlaut ß. " * 1500,
    "whitespace": ("word   \t  word\n\n\n    indented\r\n" * 1500),
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def longest(tokenizer) -> int:
    return max(map(len, tokenizer.get_vocab()))


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_the_tail_holds_the_whole_texts_last_tokens(tokenizer, longest, name, k):
    text = TEXTS[name]
    tail = truncation_tail(text, k, longest)
    assert len(tail) < len(text) // 2  # it is a real cut: these texts are long
    assert tokenizer.encode(tail)[-k:] == tokenizer.encode(text)[-k:]


def test_a_short_text_or_no_truncation_is_left_whole(longest):
    assert truncation_tail("short text", 5, longest) == "short text"
    assert truncation_tail(TEXTS["prose"], None, longest) == TEXTS["prose"]


def test_a_huge_truncated_prompt_costs_the_tokenizer_only_its_tail(server, http):
    """3.5 MB sent with truncate_prompt_tokens=8: answered, and no tokenizer call read more than
    the tail's bound (before: the whole 3.5 MB, 5-10 s of the one tokenizer thread)."""
    state = server.state
    tok, seen, lock = state.tokenizer, [], threading.Lock()
    real = tok.encode

    def counting_encode(text, *a, **kw):
        with lock:
            seen.append(len(text))
        return real(text, *a, **kw)

    huge = PARAGRAPH * (3_500_000 // len(PARAGRAPH))
    bound = 2 * (8 + 16) * state.max_token_chars  # (k + slack) tokens, moved back to a break at most as far
    tok.encode = counting_encode
    try:
        completion = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": huge, "max_tokens": 1,
                                                        "truncate_prompt_tokens": 8})
        chat = http.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 1, "truncate_prompt_tokens": 8,
                                                       "messages": [{"role": "user", "content": huge}]})
    finally:
        del tok.encode
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == 8
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == 8
    assert seen and max(seen) <= bound, seen


def test_a_truncation_longer_than_the_context_is_refused(server, http):
    """As vLLM: truncate_prompt_tokens past max_model_len is a 400 naming it."""
    r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 1,
                                           "truncate_prompt_tokens": server.state.max_model_len + 1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.fixture
def http(server):
    with server.http() as c:
        yield c
