"""What OpenAI SDK users and vLLM users send, through the official client: model lookup,
fields sent as null, token ids outside the vocabulary, and constraints that would leave the
sampler nothing to draw from (each a 400 naming the field; the engine keeps serving)."""
from __future__ import annotations

import openai
import pytest

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named
MSGS = [{"role": "user", "content": "hi"}]


def bad_request(call, param: str, says: str = "") -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    err = info.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert says in err["message"], err["message"]
    return info.value


def test_retrieve_a_model_and_an_unknown_one(client):
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_retrieve_a_model_whose_name_has_a_slash(server_factory):
    hub_named = server_factory(name="org/tiny-llama")
    assert hub_named.client().models.retrieve("org/tiny-llama").id == "org/tiny-llama"


def test_fields_sent_as_null_take_their_defaults(client):
    """Many clients send every field they know, null when unset."""
    nulls = dict(n=None, presence_penalty=None, frequency_penalty=None, logit_bias=None, logprobs=None, seed=None,
                 stop=None, temperature=None, top_p=None, user=None, stream_options=None)
    vllm_nulls = {"min_tokens": None, "ignore_eos": None, "top_k": None, "skip_special_tokens": None,
                  "priority": None, "best_of": None}
    out = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, echo=None, suffix=None,
                                    extra_body=vllm_nulls, **nulls)
    assert len(out.choices) == 1 and out.usage.completion_tokens == 3
    out = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=3, top_logprobs=None,
                                         tools=None, tool_choice=None, max_completion_tokens=None,
                                         response_format=None, extra_body=vllm_nulls, **nulls)
    assert len(out.choices) == 1 and out.usage.completion_tokens == 3


def test_malformed_json_names_no_field(server):
    with server.http() as http:
        r = http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None


def test_token_ids_outside_the_vocabulary_are_400(server, client):
    vocab = server.core.info.vocab_size
    bad_request(lambda: client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2,
                                                  logit_bias={str(vocab + 5): 10}), "logit_bias", "vocabulary")
    bad_request(lambda: client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2,
                                                       extra_body={"allowed_token_ids": [vocab]}),
                "allowed_token_ids", "vocabulary")
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("extra, param", [
    # Once a constrained output is complete only the end may follow, which min_tokens bans.
    ({"min_tokens": 4, "structured_outputs": {"choice": ["True"]}}, "min_tokens"),
    ({"allowed_token_ids": [5], "guided_regex": "[a-z]+"}, "allowed_token_ids"),
    ({"bad_words": ["True"], "guided_choice": ["True"]}, "bad_words"),
])
def test_constraints_that_can_leave_nothing_to_sample_are_400(server, client, extra, param):
    """Each of these, sampled at temperature 1, used to stop the engine for every client."""
    bad_request(lambda: client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8, temperature=1.0,
                                                  extra_body=extra), param, "structured output")
    with server.http() as http:
        assert http.get("/health").status_code == 200


def test_allowed_tokens_all_banned_is_400_and_enough_left_is_served(server, client):
    tok = server.state.tokenizer
    word = tok.encode("True", add_special_tokens=False)
    assert len(word) == 1
    other = tok.encode("None", add_special_tokens=False)[:1]
    cases = [({"allowed_token_ids": word, "bad_words": ["True"]}, True),
             ({"allowed_token_ids": word, "stop_token_ids": word, "min_tokens": 2}, True),
             ({"allowed_token_ids": word + other, "stop_token_ids": word, "min_tokens": 2}, False),
             ({"allowed_token_ids": word, "stop_token_ids": word}, False)]
    for extra, refused in cases:
        def call(extra=extra):
            return client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=1.0,
                                             extra_body=extra)
        if refused:
            bad_request(call, "allowed_token_ids", "no token to sample")
        else:
            assert call().choices[0].finish_reason in ("length", "stop")


def test_structured_output_errors_name_their_field_in_plain_words(client):
    err = bad_request(lambda: client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2,
                                                        extra_body={"guided_json": {"type": "nonsense"}}),
                      "guided_json", "nonsense")
    assert ".cc:" not in err.body["message"]  # no source locations of the grammar library
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    bad_request(lambda: client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2, tools=tools,
                                                       tool_choice="required"), "tools", "nonsense")


def test_developer_role_is_the_system_role_for_templates_without_it(server, client):
    """Newer OpenAI code sends `developer` where older code sent `system`; a template that does
    not know the role must see `system`, not render an unknown one."""
    assert "developer" not in server.state.tokenizer.chat_template
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_developer = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    want = client.chat.completions.create(model=MODEL_NAME, messages=as_system, max_tokens=6, temperature=0)
    got = client.chat.completions.create(model=MODEL_NAME, messages=as_developer, max_tokens=6, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    with server.http() as http:
        tokens = [http.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (as_system, as_developer)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("extra", ['"temperature": Infinity', '"top_p": NaN', '"logit_bias": {"5": -Infinity}',
                                   '"temperature": 1, "repetition_penalty": Infinity'])
def test_infinity_and_nan_are_400(server, extra):
    """Python's JSON parser takes them (the SDK never sends them, other clients may)."""
    body = f'{{"model": "{MODEL_NAME}", "prompt": "x", "max_tokens": 2, "guided_choice": ["a", "b"], {extra}}}'
    with server.http() as http:
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"], r.text
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("temperature, penalty, param", [
    (1e308, 1.0, "temperature"),  # infinite in float32
    (1.0, 1e-300, "repetition_penalty"),  # zero in float32
    (1.0, 1e300, "repetition_penalty"),
])
def test_scales_the_sampler_cannot_represent_are_400(client, temperature, penalty, param):
    def call(temperature: float, penalty: float):
        return client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=temperature,
                                         extra_body={"repetition_penalty": penalty, "guided_choice": ["a", "b"]})

    bad_request(lambda: call(temperature, penalty), param, "must be")
    for ok in ((1e4, 1.0), (1.0, 1e-4), (1.0, 1e4)):
        assert call(*ok).choices[0].text in ("a", "b")


def test_developer_role_is_kept_only_for_templates_that_handle_it():
    from portcullis.engine.server.prompts import chat_messages
    from portcullis.engine.server.protocol import ChatMessage

    msgs = [ChatMessage(role="developer", content="Be brief.")]
    handles = "{% if message['role'] == 'developer' %}...{% endif %}"
    mentions = "{# system and developer notes go first #}{{ message['content'] }}"
    assert chat_messages(msgs, handles)[0]["role"] == "developer"
    assert chat_messages(msgs, mentions)[0]["role"] == "system"
