"""Hostile request fields (issue 13's red-team findings 3, 5, 6, 13 and 15, engine side): a
client cannot run its own template code, fan one request out past the engine's batch, stall
other tenants with huge lists, crash a route with deep JSON, or collide with another request's
id. Each refusal is a 400 with OpenAI's error body naming the field and the limit."""
from __future__ import annotations

import pytest

from engine.server import limits

MODEL_NAME = "tiny-llama"  # as the conftest's servers are named
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LOOPING_TEMPLATE = "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"


def assert_error(r, status: int, *, param: str | None = None, says: tuple[str, ...] = ()) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    for word in says:
        assert word in err["message"], err["message"]
    return err


@pytest.fixture
def http(server):
    with server.http() as c:
        yield c


# -- finding 3: a client's chat template never runs ------------------------------------------------

@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})])
@pytest.mark.parametrize("key", ["chat_template", "tools", "documents", "conversation", "anything_else"])
def test_template_kwargs_outside_the_allowlist_are_refused_by_name(http, path, body, key):
    kwargs = {key: LOOPING_TEMPLATE if key == "chat_template" else [{"x": 1}]}
    err = assert_error(http.post(path, json={**body, "chat_template_kwargs": kwargs}), 400,
                       param="chat_template_kwargs", says=(repr(key), "enable_thinking"))
    assert all(name in err["message"] for name in limits.CHAT_TEMPLATE_KWARGS)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})])
def test_a_top_level_chat_template_is_refused(http, path, body):
    assert_error(http.post(path, json={**body, "chat_template": LOOPING_TEMPLATE}), 400, param="chat_template",
                 says=("model's own chat template",))


@pytest.mark.parametrize("value", [{"a": 1}, ["x"], "x" * (limits.MAX_TEMPLATE_KWARG_CHARS + 1)])
def test_allowed_template_kwargs_take_only_short_scalars(http, value):
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": value}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="chat_template_kwargs",
                 says=("enable_thinking",))


def test_allowed_template_kwargs_still_work(http):
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "add_vision_id": None}
    assert http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs}).status_code == 200
    r = http.post("/tokenize", json={"messages": CHAT["messages"], "chat_template_kwargs": kwargs})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_tokenize_takes_tools_at_the_top_level_as_the_chat_route_renders_them(server, http):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    counted = http.post("/tokenize", json={"messages": CHAT["messages"], "tools": tools}).json()["count"]
    chat = http.post("/v1/chat/completions", json={**CHAT, "tools": tools}).json()
    assert counted == chat["usage"]["prompt_tokens"]


# -- finding 13: deep JSON ------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model":"tiny-llama","prompt":"x","metadata":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model":"tiny-llama","prompt":"x","metadata":' + b"[" * 500 + b"]" * 500 + b"}",
])
def test_deeply_nested_json_is_a_400_saying_so(http, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, says=("nested", str(limits.MAX_JSON_DEPTH)))


def test_a_deep_json_schema_never_reaches_the_grammar_compiler(http):
    # 450 nested objects took the grammar compiler 10 s, holding the tokenizer thread for everyone.
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, says=("nested",))
    shallow = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    body["response_format"]["json_schema"]["schema"] = shallow
    assert http.post("/v1/chat/completions", json=body).status_code == 200

