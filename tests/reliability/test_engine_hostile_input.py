"""What one request's stop conditions cost the engine per token (issue 13, finding 6): bounded
by the new text, not by the output so far, the stop strings' lengths or the stop id count. The
costs are counted (comparisons made), not timed, so the tests cannot flake on a busy machine.
And the red team's requests against a real engine process: refused, the engine still serving."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portcullis.engine.core.request import Request
from portcullis.engine.frontend.detokenizer import IncrementalDetokenizer
from portcullis.engine.sampling_params import SamplingParams
from portcullis.protocol import caps


class CharTokenizer:
    """One token per character: the text the detokenizer sees is exactly what the test chose."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


class CountingStr(str):
    """A stop string that counts how often the matcher looks at one of its characters."""

    looks = 0

    def __getitem__(self, key):
        CountingStr.looks += 1
        return super().__getitem__(key)


class CountingInt(int):
    """A stop token id that counts the comparisons made against it."""

    compared = 0

    def __eq__(self, other):
        CountingInt.compared += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


def test_stop_string_work_per_token_is_bounded_by_the_new_text():
    # The most stop strings of the longest length a request may send, and an output that keeps
    # almost matching none of them: the old check sliced every prefix of every stop string per
    # token (16 x 255 per token here, quadratic in their length).
    stops = [CountingStr(f"{i:02d}" + "a" * (caps.MAX_STOP_CHARS - 2)) for i in range(caps.MAX_STOP_STRINGS)]
    CountingStr.looks = 0
    d = IncrementalDetokenizer(CharTokenizer(), stop=stops)
    tokens = 2000
    shown = "".join(d.update([ord("c")]) for _ in range(tokens))
    assert shown == "c" * tokens and d.stop_reason is None
    per_char = 4  # KMP: amortised under 3 looks per character per stop string
    assert CountingStr.looks <= per_char * len(stops) * (tokens + caps.MAX_STOP_CHARS)


def test_stop_work_does_not_grow_with_the_output():
    def looks(tokens: int) -> int:
        CountingStr.looks = 0
        d = IncrementalDetokenizer(CharTokenizer(), stop=[CountingStr("STOP"), CountingStr("abab" * 8)])
        for i in range(tokens):
            d.update([ord("ab"[i % 2])])
        return CountingStr.looks

    assert looks(4000) <= 10 * looks(400) + 200  # linear in the tokens: constant per token


def brute_held(text: str, stops: list[str]) -> int:
    """The definition: the longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab", max_size=40), stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=6),
                                                                min_size=1, max_size=4))
def test_held_back_text_is_exactly_what_could_still_become_a_stop_string(text, stops):
    d = IncrementalDetokenizer(CharTokenizer(), stop=stops)
    shown = ""
    for i, c in enumerate(text):
        shown += d.update([ord(c)])
        seen = text[: i + 1]
        match = min(((seen.find(s), s) for s in stops if s in seen), default=None)
        if match is not None:  # the earliest stop string cut the text and ended it
            assert d.stop_reason == match[1] and d.text == seen[: match[0]] == shown
            return
        assert shown == seen[: len(seen) - brute_held(seen, stops)]


def test_a_stop_token_check_costs_the_same_however_many_stop_ids():
    ids = [CountingInt(t) for t in range(1000, 1000 + caps.MAX_STOP_TOKEN_IDS)]
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=500, stop_token_ids=ids), block_size=16,
                  max_model_len=1000, eos_token_ids=(2,))
    CountingInt.compared = 0
    for _ in range(200):
        req.append_output_token(7)
        assert req.check_stop() is None
    assert CountingInt.compared <= 10  # a list scan made 256 comparisons per token
    req.append_output_token(ids[-1])
    assert req.check_stop() is not None and req.check_stop().finished


@pytest.mark.parametrize("body, param", [
    ({"stop": ["z" * 3000] * 100}, "stop"),
    ({"stop_token_ids": [7] * 1_500_000}, "stop_token_ids"),
    ({"bad_words": ["hello"] * 50_000, "n": 8}, "bad_words"),
    # The review's n:64 x logprobs:20 is refused by the gateway's max_n; the engine, like vLLM,
    # allows 20 logprobs, so one past its cap here.
    ({"n": 64, "logprobs": 21}, "logprobs"),
    ({"prompt": ["p"] * 9, "n": 128}, "n"),
])
def test_the_red_teams_requests_are_refused_by_a_real_engine(engine, body, param):
    with engine.http() as http:
        r = http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}).status_code == 200
