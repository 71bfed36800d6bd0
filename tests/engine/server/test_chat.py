"""`/v1/chat/completions` through the official client: the model's chat template, plain and
streamed responses, usage, n."""
from __future__ import annotations

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def chat_stream(client, **kw):
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    roles: dict[int, list] = {}
    chunks = list(client.chat.completions.create(model=MODEL_NAME, stream=True, **kw))
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons.setdefault(c.index, []).append(c.finish_reason)
            if c.delta.role:
                roles.setdefault(c.index, []).append(c.delta.role)
    return texts, reasons, roles, chunks


def test_prompt_is_rendered_with_the_models_chat_template(server, client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0)
    rendered = server.state.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert out.usage.prompt_tokens == len(server.state.tokenizer.encode(rendered, add_special_tokens=False))
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens == out.usage.prompt_tokens + 5
    # The same prompt by /v1/completions gives the same greedy text.
    plain = client.completions.create(model=MODEL_NAME, prompt=rendered, max_tokens=5, temperature=0)
    assert plain.choices[0].text == out.choices[0].message.content


def test_stream_equals_plain_with_role_first_and_one_finish_reason(client):
    kw = dict(messages=MESSAGES, max_completion_tokens=10, temperature=0)
    plain = client.chat.completions.create(model=MODEL_NAME, **kw)
    texts, reasons, roles, chunks = chat_stream(client, stream_options={"include_usage": True}, **kw)
    assert texts[0] == plain.choices[0].message.content
    assert roles[0] == ["assistant"] and chunks[0].choices[0].delta.role == "assistant"
    assert reasons[0][-1] == "length" and reasons[0].count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_n_two_streams_two_choices_each_finishing_once(client):
    texts, reasons, roles, _ = chat_stream(client, messages=MESSAGES, max_tokens=6, n=2, temperature=1.0, seed=5)
    assert sorted(texts) == [0, 1] and texts[0] != texts[1]
    assert all(r.count("length") == 1 and r[-1] == "length" for r in reasons.values())


def test_stop_string_in_chat(client):
    base = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    text = base.choices[0].message.content
    stop = text[8:11]
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0, stop=stop)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.index(stop)]


def test_content_parts_and_unsupported_parts(server, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    as_parts = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=4, temperature=0)
    as_text = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
                                             max_tokens=4, temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    with server.http() as http:
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": image})
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
