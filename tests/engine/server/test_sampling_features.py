"""The sampler's features through the API: penalties and biases give what the offline API
gives, logprobs come in OpenAI's shapes (plain, streamed, echoed), and structured output
constrains the text."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from portcullis.engine import SamplingParams
from portcullis.engine.sampling_params import StructuredOutputsParams

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named
GREEDY = dict(model=MODEL_NAME, temperature=0)


def offline_text(server, offline, prompt: str, **params) -> str:
    ids = server.state.tokenizer.encode(prompt)
    return offline.generate([ids], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("extra", [
    {"frequency_penalty": 1.5}, {"presence_penalty": -1.0}, {"repetition_penalty": 1.8},
    {"min_p": 0.2, "temperature": 1.0, "seed": 4},
])
def test_penalties_and_min_p_match_the_offline_api(server, client, offline, extra):
    extra = {"temperature": 0, **extra}
    out = client.completions.create(model=MODEL_NAME, prompt="Repeat after me", max_tokens=16,
                                    extra_body={k: v for k, v in extra.items() if k not in ("temperature", "seed")},
                                    temperature=extra["temperature"], seed=extra.get("seed"))
    assert out.choices[0].text == offline_text(server, offline, "Repeat after me", max_tokens=16, **extra)


def test_generation_config_penalties_are_defaults_a_request_overrides(server_factory, offline):
    from portcullis.engine.server.settings import GenerationDefaults

    server = server_factory(generation=GenerationDefaults(repetition_penalty=1.8, min_p=0.2))
    with server.client() as client:
        def text(**extra) -> str:
            return client.completions.create(model=MODEL_NAME, prompt="Repeat after me", max_tokens=16,
                                             temperature=0, extra_body=extra).choices[0].text

        penalized = offline_text(server, offline, "Repeat after me", max_tokens=16, temperature=0,
                                 repetition_penalty=1.8, min_p=0.2)
        plain = offline_text(server, offline, "Repeat after me", max_tokens=16, temperature=0)
        assert penalized != plain  # else this test could not tell whether the default applied
        assert text() == penalized and text(repetition_penalty=1.0, min_p=0.0) == plain


def test_logit_bias_allowed_ids_and_bad_words(server, client):
    tok = server.state.tokenizer
    forced = tok.encode(" cat")[0]
    out = client.completions.create(prompt="Animals:", max_tokens=4, logit_bias={str(forced): 100}, **GREEDY)
    assert out.choices[0].text == tok.decode([forced] * 4)
    allowed = tok.encode(" dog")[:1] + tok.encode(" fish")[:1]
    out = client.completions.create(prompt="Animals:", max_tokens=6, extra_body={"allowed_token_ids": allowed}, **GREEDY)
    assert set(tok.encode(out.choices[0].text)) <= set(allowed)
    plain = client.completions.create(prompt="Animals:", max_tokens=8, **GREEDY)
    first = tok.decode(tok.encode(plain.choices[0].text)[:1]).strip()
    if len(tok.encode(first, add_special_tokens=False)) == 1 and first:
        banned = client.completions.create(prompt="Animals:", max_tokens=8, extra_body={"bad_words": [first]}, **GREEDY)
        assert banned.choices[0].text != plain.choices[0].text


def test_completion_logprobs_plain_and_streamed(client):
    kw = dict(prompt="Logprobs please", max_tokens=6, logprobs=2, **GREEDY)
    out = client.completions.create(**kw)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 2 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_echo_with_logprobs_scores_the_prompt(server, client):
    """What lm-eval-harness sends to score a continuation: echo, logprobs, one new token."""
    prompt = "The capital of France is Paris"
    out = client.completions.create(prompt=prompt, max_tokens=1, echo=True, logprobs=1, **GREEDY)
    lp = out.choices[0].logprobs
    n_prompt = len(server.state.tokenizer.encode(prompt))
    assert len(lp.tokens) == n_prompt + 1 and out.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs_with_top_alternatives(client):
    msgs = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == out.choices[0].message.content
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    tokens = [t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


def test_prompt_logprobs_extra(server):
    with server.http() as http:
        body = {"model": MODEL_NAME, "prompt": "abc def", "max_tokens": 1, "prompt_logprobs": 2}
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(server.state.tokenizer.encode("abc def"))
    assert all(any(v["rank"] >= 1 and v["logprob"] <= 0 for v in entry.values()) for entry in plp[1:])


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
          "required": ["ok", "kind"], "additionalProperties": False}


def test_structured_output_json_schema_choice_and_regex(client):
    msgs = [{"role": "user", "content": "Give JSON"}]
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    out = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=48, temperature=1.0, seed=1,
                                         response_format=rf)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=16, temperature=1.0, seed=2, n=2,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe later"]}})
    assert all(c.text in ("yes", "no", "maybe later") and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=16, temperature=1.0, seed=3,
                                    extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.choices[0].text)


def _json_mode_replies(client, seed: int) -> list[tuple[str, str]]:
    """(text, finish_reason) of JSON mode in each spelling: chat's and completions' response_format,
    vLLM's structured_outputs."""
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "JSON?"}],
                                          max_tokens=48, temperature=1.0, seed=seed,
                                          response_format={"type": "json_object"})
    out = [(chat.choices[0].message.content, chat.choices[0].finish_reason)]
    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        text = client.completions.create(model=MODEL_NAME, prompt="JSON:", max_tokens=48, temperature=1.0,
                                         seed=seed, extra_body=extra)
        out.append((text.choices[0].text, text.choices[0].finish_reason))
    return out


def test_json_object_is_an_object_in_every_spelling(client):
    # OpenAI's JSON mode promises an object; any JSON value (`[0]`) breaks LangChain's JSON mode.
    replies = [reply for seed in range(6) for reply in _json_mode_replies(client, seed)]
    assert all(text.startswith("{") for text, _ in replies), replies  # a random model's keys may outrun max_tokens
    finished = [json.loads(text) for text, reason in replies if reason == "stop"]
    assert len(finished) >= 2 and all(isinstance(obj, dict) for obj in finished), replies


def test_json_object_grammar_is_an_object_with_or_without_reasoning(server):
    import xgrammar as xgr

    from portcullis.engine.core.structured_output import GrammarCompiler
    from portcullis.engine.server.reasoning import after_reasoning

    tok, spec = server.state.tokenizer, StructuredOutputsParams(json_object=True)
    end = tok.eos_token_id
    compiler = GrammarCompiler(tok, len(tok), (end,))
    object_only = compiler.compile(spec)
    after_thought = compiler.compile(StructuredOutputsParams(grammar=after_reasoning(spec)))

    def accepts(grammar, text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) \
            and matcher.accept_token(end)

    for grammar, before in ((object_only, ""), (after_thought, "thought</think>")):
        assert accepts(grammar, before + '{"a": [0, {}]}') and accepts(grammar, before + "{}")
        assert not any(accepts(grammar, before + text) for text in ("[0]", "[[], {}]", "0", '"a"'))


def test_bad_structured_output_requests_are_400(server):
    with server.http() as http:
        base = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4}
        for extra, param in [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
            ({"response_format": {"type": "yaml"}}, "response_format"),
            ({"guided_regex": "([a-z"}, "guided_regex"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
            ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
            ({"logprobs": 50}, "logprobs"),
            ({"bad_words": ["several words here"]}, "bad_words"),
        ]:
            r = http.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
        assert http.post("/v1/chat/completions", json=chat).json()["error"]["param"] == "top_logprobs"
