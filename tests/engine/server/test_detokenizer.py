"""Incremental detokenization: streamed deltas add up to the full decode, never show half a
character, and never show text a stop string later cuts."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from portcullis.engine.assets import DEMO_MODEL_DIR
from portcullis.engine.frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def stream(tok, ids, chunk=1, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kw)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(d.update(ids[i : i + chunk], final=i + chunk >= len(ids)))
    return deltas, d


def test_multibyte_characters_split_across_tokens_are_held_back(tok):
    text = "ok 🙂 你好 é €"
    ids = tok.encode(text)
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # never half a character
    assert len(ids) > len(text.split())  # the characters really were split over several tokens


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 4095), min_size=0, max_size=40), chunk=st.integers(1, 4))
def test_deltas_add_up_to_the_full_decode(tok, ids, chunk):
    deltas, d = stream(tok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == d.text


def test_special_tokens_follow_skip_special_tokens(tok):
    ids = tok.encode("hi") + [2] + tok.encode(" there")
    assert "".join(stream(tok, ids)[0]) == "hi there"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "hi<|im_end|> there"


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text)
    deltas, d = stream(tok, ids, stop=["ma del"])
    assert d.stop_reason == "ma del"
    assert d.text == "alpha beta gam"
    assert "".join(deltas) == "alpha beta gam"
    # Once stopped, further tokens change nothing.
    assert d.update(tok.encode(" more")) == "" and d.text == "alpha beta gam"


def test_possible_stop_prefix_is_held_until_it_cannot_match(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    shown = d.update(tok.encode("go ST"))
    assert shown == "go "  # "ST" may be the start of "STOP"
    shown += d.update(tok.encode("AY"))
    assert shown == "go STAY"
    shown += d.update(tok.encode(" and ST"), final=True)  # at the end nothing is held back
    assert shown == "go STAY and ST" and d.stop_reason is None


def test_earliest_of_several_stop_strings_wins_and_include_keeps_it(tok):
    ids = tok.encode("one two three four")
    _, d = stream(tok, ids, chunk=len(ids), stop=["four", "two"])
    assert (d.text, d.stop_reason) == ("one ", "two")
    deltas, d = stream(tok, ids, stop=["three"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.text == "one two three"


def test_stop_strings_are_not_matched_while_told_not_to(tok):
    """Before min_tokens the server passes match_stop=False: an early occurrence is not a stop."""
    d = IncrementalDetokenizer(tok, stop=["b"])
    text = d.update(tok.encode("a b"), match_stop=False)
    text += d.update(tok.encode(" c b d"), final=True)
    assert d.stop_reason == "b" and text == "a b c "


def test_sentencepiece_output_keeps_its_leading_space_after_the_prompt():
    # "▁return" decoded alone reads "return"; after the prompt it reads " return", and so must
    # the streamed deltas and the one-shot decode the offline API uses.
    from portcullis.engine.frontend.detokenizer import decode_after
    from tests.engine.server.test_fim import code_llama

    tok = code_llama()
    prompt = tok.encode("def f():\n")
    output = tok.encode(" return x", add_special_tokens=False)
    whole = tok.decode(prompt + output, skip_special_tokens=True)
    want = whole[len(tok.decode(prompt, skip_special_tokens=True)):]
    assert want.startswith(" return") and not tok.decode(output).startswith(" ")
    detok = IncrementalDetokenizer(tok, context=prompt)
    streamed = "".join(detok.update([t]) for t in output) + detok.update([], final=True)
    assert streamed == want == detok.text
    assert decode_after(tok, prompt, output, skip_special_tokens=True) == want
