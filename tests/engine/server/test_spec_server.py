"""Speculative decoding and Predicted Outputs over the API: the same text as without them,
OpenAI's prediction usage, vLLM's spec-decode metrics."""
from __future__ import annotations

import pytest

from tests.support.openai_errors import assert_error

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = "a b c a b c a b c a b"


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, server_model):
    from tests.engine.server.conftest import start_server

    running = start_server(server_model, tmp_path_factory.mktemp("spec"), engine=dict(speculative_config=NGRAM))
    yield running
    running.stop()


def test_speculation_changes_nothing_a_client_sees(spec_server, client):
    body = dict(model="tiny-llama", prompt=PROMPT, max_tokens=40, temperature=0)
    plain = client.completions.create(**body)
    fast = spec_server.client().completions.create(**body)
    assert fast.choices[0].text == plain.choices[0].text and fast.usage.completion_tokens == plain.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in spec_server.client().completions.create(**body, stream=True) if c.choices)
    assert streamed == plain.choices[0].text
    with spec_server.http() as http:
        text = http.get("/metrics").text
    drafts = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0


def test_prediction_usage_as_openai_reports_it(client, server):
    body = dict(model="tiny-llama", prompt=PROMPT, max_tokens=32, temperature=0)
    plain = client.completions.create(**body, extra_body={"ignore_eos": True})
    prediction = {"type": "content", "content": plain.choices[0].text}
    predicted = client.completions.create(**body, extra_body={"ignore_eos": True, "prediction": prediction})
    assert predicted.choices[0].text == plain.choices[0].text  # a prediction never changes the output
    details = predicted.usage.completion_tokens_details
    predicted_ids = server.state.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)
    # The text re-tokenizes differently here in places (random weights), so not every token is accepted.
    assert 0 < details.accepted_prediction_tokens <= 32
    assert details.rejected_prediction_tokens == len(predicted_ids) - details.accepted_prediction_tokens
    wrong = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=0, prediction={"type": "content", "content": "zzzz qqqq"})
    usage = wrong.usage.completion_tokens_details
    assert usage.rejected_prediction_tokens >= 1


@pytest.mark.parametrize("prediction", [{"type": "text", "content": "x"}, {"type": "content", "content": 5},
                                        {"type": "content", "content": "x" * 200_001}])
def test_bad_predictions_are_400(server, prediction):
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "prediction": prediction})
        assert_error(r, 400, param="prediction")
