"""Errors typed by who is at fault (issue 33): only the engine's refusal of a request
(`RequestError`, naming its field) is a client's 400; any other error inside the engine is a
500 naming the request id, which the log carries with the traceback, never a "bad request"."""
from __future__ import annotations

import logging

import pytest

from portcullis.engine.errors import RequestError

COMPLETION = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}


@pytest.fixture
def failing_add(server, monkeypatch):
    """Make the engine's queueing of a request raise `error` for the next requests."""
    def install(error: Exception) -> None:
        async def add(*args, **kwargs):
            raise error
        monkeypatch.setattr(server.state.engine, "add", add)
    return install


def test_an_internal_value_error_is_a_500_with_the_request_id(server, failing_add, caplog):
    failing_add(ValueError("an invariant of ours broke"))
    with caplog.at_level(logging.ERROR), server.http() as http:
        r = http.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "fault-test-1"})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "internal_error" and "fault-test-1" in error["message"]
    assert "invariant" not in error["message"]  # the internals stay in the log
    assert r.headers["x-request-id"] == "fault-test-1"


def test_a_refusal_is_a_400_naming_its_field(server, failing_add):
    failing_add(RequestError("max_tokens is too large for this test", "max_tokens"))
    with server.http() as http:
        r = http.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"


def test_the_server_keeps_serving_after_an_internal_error(server, failing_add, monkeypatch):
    failing_add(ValueError("once"))
    with server.http() as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 500
        monkeypatch.undo()
        r = http.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- structured output after reasoning: the client's schema is a 400, our grammar's failure a 500 ----

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}


@pytest.fixture(scope="module")
def reasoning_server(server_model, tmp_path_factory):
    """Structured output constrains only what follows the reasoning: its grammar is built in the route."""
    from tests.engine.server.conftest import start_server

    running = start_server(server_model, tmp_path_factory.mktemp("reasoning"), reasoning_parser="deepseek_r1")
    yield running
    running.stop()


def test_a_schema_xgrammar_cannot_read_is_a_400_naming_the_field(reasoning_server):
    with reasoning_server.http() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "response_format": BAD_SCHEMA})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "nonsense" in error["message"]


def test_a_failure_of_the_reasoning_grammar_is_a_500_with_the_request_id(reasoning_server, monkeypatch):
    import xgrammar

    def broken(*args, **kwargs):  # a RuntimeError, as xgrammar raises for a client's bad grammar too
        raise RuntimeError("our structural tag broke")

    monkeypatch.setattr(xgrammar.Grammar, "from_structural_tag", staticmethod(broken))
    with reasoning_server.http() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "guided_regex": "answer"},
                      headers={"x-request-id": "fault-grammar-1"})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "internal_error" and "fault-grammar-1" in error["message"]


# -- the chat template: its refusal of the client's messages is a 400, a fault of ours a 500 ---------

REFUSING_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system "
                     "messages here') }}{% endif %}{{ m.content }}{% endfor %}")


def test_a_template_refusing_the_messages_is_a_400(server, monkeypatch):
    monkeypatch.setattr(server.state.tokenizer, "chat_template", REFUSING_TEMPLATE)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "no system messages here" in error["message"]


LOOPING_TEMPLATE = "{% for m in messages %}{% for call in m.tool_calls or [] %}{{ call.id }}{% endfor %}{% endfor %}"


def test_a_template_choking_on_a_fields_shape_is_a_400(server, monkeypatch):
    """Extra message fields reach the template as sent: one of the wrong shape is the client's fault."""
    monkeypatch.setattr(server.state.tokenizer, "chat_template", LOOPING_TEMPLATE)
    messages = [{"role": "assistant", "content": "hi", "tool_calls": 5}, {"role": "user", "content": "hello"}]
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("error", [TypeError("a bug of ours"), ValueError("an invariant of ours broke")])
def test_an_error_of_ours_while_rendering_is_a_500_with_the_request_id(server, monkeypatch, error):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(server.state.tokenizer, "apply_chat_template", broken)
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "fault-template-1"})
    assert r.status_code == 500, r.text
    body = r.json()["error"]
    assert body["code"] == "internal_error" and "fault-template-1" in body["message"]
