"""LangChain's ChatOpenAI against `portcullis serve`, with its defaults: invoke, stream, tools bound
with its default tool_choice ("auto"), and `with_structured_output` in each of its methods. Free
text is steered with `extra_body={"guided_regex": ...}` (random weights); structured replies are
bounded by their schema, so they finish within max_tokens. Nothing here counts tokens locally
(tiktoken would download its encodings)."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import pydantic
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI

from .conftest import MODEL


class Weather(pydantic.BaseModel):
    """Weather in a city."""
    city: Literal["Oslo", "Paris"]
    celsius: int = pydantic.Field(ge=-50, le=50)


class Note(pydantic.BaseModel):
    """What JSON mode may give: any object, so every field has a default."""
    city: str = "unknown"


def _chat(served, **kw) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=served["base"] + "/v1", api_key=served["key"], **kw)


def test_invoke_and_usage(served):
    reply = _chat(served, max_tokens=16, extra_body={"guided_regex": "Hello there\\."}).invoke("Say hello.")
    assert reply.content == "Hello there." and reply.response_metadata["finish_reason"] == "stop"
    assert reply.usage_metadata["input_tokens"] > 5 and reply.usage_metadata["output_tokens"] >= 3


def test_stream_adds_up_to_the_reply_with_usage(served):
    chunks = list(_chat(served, max_tokens=16, stream_usage=True, extra_body={"guided_regex": "Hello there\\."})
                  .stream("Say hello."))
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and len(chunks) > 2
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == "Hello there." and whole.usage_metadata["output_tokens"] >= 3


def test_bind_tools_with_its_default_auto_choice(served):
    call = '{"name": "Weather", "arguments": {"city": "Oslo", "celsius": 3}}'
    bound = _chat(served, max_tokens=80, extra_body={"guided_regex": re.escape(call)}).bind_tools([Weather])
    assert "tool_choice" not in bound.kwargs  # LangChain leaves it to the server: "auto"
    reply = bound.invoke("Weather in Oslo?")
    [made] = reply.tool_calls
    assert made["name"] == "Weather" and Weather(**made["args"]) == Weather(city="Oslo", celsius=3)
    assert reply.response_metadata["finish_reason"] == "tool_calls" and not reply.invalid_tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_with_a_schema(served, method):
    structured = _chat(served, max_tokens=100).with_structured_output(Weather, method=method, include_raw=True)
    for seed in range(2):
        out = structured.invoke("Weather in Oslo, as JSON.", seed=seed)
        assert out["parsing_error"] is None and isinstance(out["parsed"], Weather)


def test_structured_output_in_json_mode_is_an_object(served):
    # JSON mode constrains the reply to an object (issue 30: it could be an array); the bias on "}"
    # makes the random model close it within max_tokens.
    close = str(_token_id(served, "}"))
    structured = _chat(served, max_tokens=100, logit_bias={close: 20}).with_structured_output(
        Note, method="json_mode", include_raw=True)
    for seed in range(3):
        out = structured.invoke("Weather in Oslo, as JSON.", seed=seed, temperature=1.0)
        assert isinstance(json.loads(out["raw"].content), dict)
        assert out["parsing_error"] is None and isinstance(out["parsed"], Note)


def _token_id(served, text: str) -> int:
    r = httpx.post(served["base"] + "/tokenize", json={"model": MODEL, "prompt": text},
                   headers={"Authorization": f"Bearer {served['key']}"})
    [token] = r.json()["tokens"]
    return token
