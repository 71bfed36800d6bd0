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
