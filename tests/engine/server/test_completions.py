"""`/v1/completions` through the official client: plain and streamed, usage, stops, n, echo,
token-id prompts, and `/tokenize` + `/detokenize`."""
from __future__ import annotations

import pytest

from portcullis.engine import SamplingParams

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named

GREEDY = dict(model=MODEL_NAME, temperature=0)


def stream_text(client, **kw) -> tuple[dict[int, str], dict[int, list], list]:
    """Texts and finish reasons per choice index, and every chunk, of a streamed completion."""
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    chunks = list(client.completions.create(stream=True, **kw))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons.setdefault(c.index, []).append(c.finish_reason)
    return texts, reasons, chunks


def test_plain_completion_counts_tokens_exactly(server, client):
    prompt = "The quick brown fox"
    out = client.completions.create(prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    n_prompt = len(server.state.tokenizer.encode(prompt))
    u = out.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, 7, n_prompt + 7)
    assert u.prompt_tokens_details.cached_tokens == 0


def test_stream_text_equals_plain_text_and_finish_reason_comes_once(client):
    kw = dict(prompt="Once upon a time", max_tokens=12, **GREEDY)
    plain = client.completions.create(**kw)
    texts, reasons, chunks = stream_text(client, stream_options={"include_usage": True}, **kw)
    assert texts[0] == plain.choices[0].text
    assert reasons[0][-1] == "length" and reasons[0][:-1] == [None] * (len(reasons[0]) - 1)
    # include_usage: every chunk has usage null except a last one with no choices.
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 12


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    _, _, chunks = stream_text(client, prompt="abc", max_tokens=4, stream_options=opts, **GREEDY)
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == 4


def test_stop_string_ends_with_stop_and_is_not_in_the_text(client):
    base = client.completions.create(prompt="Tell me a story", max_tokens=24, **GREEDY).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    cut = base[: base.index(stop)]
    out = client.completions.create(prompt="Tell me a story", max_tokens=24, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == cut and stop not in out.choices[0].text
    assert out.usage.completion_tokens < 24
    texts, reasons, _ = stream_text(client, prompt="Tell me a story", max_tokens=24, stop=stop, **GREEDY)
    assert texts[0] == cut and reasons[0][-1] == "stop"


def test_stop_token_ids_end_with_stop(server, client, offline):
    prompt = server.state.tokenizer.encode("Hello")
    ids = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    out = client.completions.create(prompt=prompt, max_tokens=10, extra_body={"stop_token_ids": [stop_id]}, **GREEDY)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == stop_id
    assert out.usage.completion_tokens == first + 1  # the stop token counts, as in vLLM...
    assert out.choices[0].text == server.state.tokenizer.decode(ids[:first])  # ...but its text is not shown


def test_max_tokens_gives_length_with_exactly_that_many_tokens(client):
    for n in (1, 5):
        out = client.completions.create(prompt="count", max_tokens=n, **GREEDY)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == n


@pytest.mark.parametrize("seed", [11, 2**64 - 2])
def test_seeded_n_samples_equal_the_offline_api(server, client, offline, seed):
    """One seed rule (`sample_seed`) for the server and `LLM`: the same n texts for one seed,
    also where seed + i passes 2**64."""
    prompt = "Pick a word:"
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=seed)
    ids = server.state.tokenizer.encode(prompt)
    ref = offline.generate([ids], SamplingParams(n=3, seed=seed, temperature=1.0, max_tokens=8), use_tqdm=False)
    assert [c.text for c in out.choices] == [c.text for c in ref[0].outputs]
    assert len({c.text for c in out.choices}) > 1


def test_n_two_gives_two_distinct_seeded_choices(client):
    kw = dict(model=MODEL_NAME, prompt="Pick a word:", max_tokens=8, n=2, temperature=1.0, seed=11)
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text != out.choices[1].text  # seed + i per sample
    assert out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens == client.completions.create(**{**kw, "n": 1}).usage.prompt_tokens  # once
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    texts, reasons, _ = stream_text(client, **kw)
    assert [texts[0], texts[1]] == [c.text for c in out.choices]
    assert all(r[-1] == "length" and r.count("length") == 1 for r in reasons.values())


def test_echo_prepends_the_prompt(client):
    out = client.completions.create(prompt="Echo this", max_tokens=3, echo=True, **GREEDY)
    plain = client.completions.create(prompt="Echo this", max_tokens=3, **GREEDY)
    assert out.choices[0].text == "Echo this" + plain.choices[0].text
    texts, _, _ = stream_text(client, prompt="Echo this", max_tokens=3, echo=True, **GREEDY)
    assert texts[0] == out.choices[0].text


def test_prompts_as_token_ids_and_batches(server, client):
    ids = server.state.tokenizer.encode("Token ids in")
    by_text = client.completions.create(prompt="Token ids in", max_tokens=5, **GREEDY)
    by_ids = client.completions.create(prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(prompt=[ids, [5, 6, 7]], max_tokens=5, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 3
    strings = client.completions.create(prompt=["Token ids in", "other"], max_tokens=5, **GREEDY)
    assert strings.choices[0].text == by_text.choices[0].text


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = " ".join(f"word{i}" for i in range(40))  # several full 16-token blocks
    first = client.completions.create(prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(prompt=prompt, max_tokens=2, **GREEDY)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == ((n - 1) // 16) * 16 > 0
    other_tenant = client.completions.create(prompt=prompt, max_tokens=2, extra_body={"cache_salt": "tenant-b"}, **GREEDY)
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0


def test_tokenize_then_detokenize_round_trips(server):
    with server.http() as http:
        text = "Round trip: héllo 🙂"
        tok = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
        back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tok["tokens"]}).json()
        assert back["prompt"] == text
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["count"] > 3


def test_request_id_header_is_echoed_and_prefixes_the_id(server):
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                      headers={"x-request-id": "gw-1234"})
        assert r.headers["x-request-id"] == "gw-1234" and r.json()["id"] == "cmpl-gw-1234"
        assert r.headers.get("x-request-id") and http.get("/v1/models").headers.get("x-request-id")


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
