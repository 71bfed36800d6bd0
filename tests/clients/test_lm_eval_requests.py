"""lm-eval's `local-completions` loglikelihood, without installing lm-eval: the requests it sends
(`/v1/completions`, a batch of token-id prompts or texts, `echo`, `logprobs: 1`, `max_tokens: 1`,
`temperature: 0`, a seed) and what it reads back — for each (context, continuation) the sum of
`token_logprobs[ctxlen:-1]` and `is_greedy`, every continuation token equal to the best of its
`top_logprobs`. Token ids come from the server's /tokenize, as lm-eval's remote tokenizer does."""
from __future__ import annotations

import math

import httpx
import pytest

from .conftest import MODEL


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served["base"], headers={"Authorization": f"Bearer {served['key']}"},
                      timeout=60) as c:
        yield c


def _ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]


def _scored(http, prompts: list) -> list[dict]:
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def _parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's parse_logprobs computes from one choice."""
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(lp == max(t.values()) for lp, t in zip(logprobs, top))


def test_loglikelihood_of_token_id_prompts(http):
    context = _ids(http, "def add(a, b):\n    return")
    # The greedy next token: the best of the top_logprobs after the context, mapped back to its id.
    [probe] = _scored(http, [context])
    best = max(probe["logprobs"]["top_logprobs"][-1].items(), key=lambda kv: kv[1])[0]
    greedy = _ids(http, best)
    assert len(greedy) == 1, f"the greedy token {best!r} does not round-trip through /tokenize"
    other = _ids(http, " a + b")
    assert other[:1] != greedy
    choices = _scored(http, [context + greedy, context + other])
    for choice, continuation in zip(choices, (greedy, other)):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1  # echoed prompt + 1 generated
        assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
        assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    (greedy_ll, greedy_is), (other_ll, other_is) = (_parse(c, len(context)) for c in choices)
    assert greedy_is and not other_is
    assert math.isclose(greedy_ll, probe["logprobs"]["top_logprobs"][-1][best], abs_tol=1e-3)
    assert other_ll < greedy_ll


def test_text_prompts_score_as_their_token_ids(http):
    texts = ["The capital of France is Paris", "2 + 2 = 4"]
    by_text = _scored(http, texts)
    by_ids = _scored(http, [_ids(http, t) for t in texts])
    for a, b in zip(by_text, by_ids):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        for x, y in zip(a["logprobs"]["token_logprobs"][1:-1], b["logprobs"]["token_logprobs"][1:-1]):
            assert math.isclose(x, y, abs_tol=1e-3)
