"""OpenAI's Responses API on the engine (issue 30), through the official SDK's `responses`
client as the Agents SDK and Codex use it: plain and streamed replies, a function-call round
trip with `previous_response_id`, tenants' stored responses kept apart. What the model writes is
steered with `guided_regex` where a test needs a given reply (random weights)."""
from __future__ import annotations

import json
import re

import openai
import pytest

MODEL_NAME = "tiny-llama"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.fixture
def engine(agent_server):
    return agent_server


@pytest.fixture
def client(engine):
    return engine.client()


def _as(client: openai.OpenAI, tenant: str) -> openai.OpenAI:
    return client.with_options(default_headers={"x-portcullis-tenant": tenant})


def test_a_plain_response(client):
    r = client.responses.create(model=MODEL_NAME, input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                                extra_body={"guided_regex": "Hello there\\."})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there."
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens > 5 and r.usage.output_tokens >= 3
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = client.responses.create(model=MODEL_NAME, input="Say hello.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_is_the_sdks_event_sequence(client):
    events = list(client.responses.create(model=MODEL_NAME, input="Say hello.", max_output_tokens=16, stream=True,
                                          extra_body={"guided_regex": "Hello there\\."}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
    done = events[-1].response
    assert done.output_text == "Hello there." and done.usage.input_tokens > 5


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip_with_previous_response_id(client, stream):
    first = dict(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=40,
                 extra_body={"guided_regex": re.escape(CALL)})
    if stream:
        events = list(client.responses.create(**first, stream=True))
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert json.loads(args) == {"city": "Oslo"}
        response = events[-1].response
    else:
        response = client.responses.create(**first)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    follow = client.responses.create(
        model=MODEL_NAME, previous_response_id=response.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3 degrees"}],
        extra_body={"guided_regex": "Cold\\."})
    assert follow.output_text == "Cold." and follow.previous_response_id == response.id
    # The conversation was carried over: the first turn and the call are in the prompt.
    assert follow.usage.input_tokens > response.usage.input_tokens
    assert client.responses.retrieve(follow.id).output_text == "Cold."


def test_stored_responses_are_each_tenants_own(client):
    mine = _as(client, "acme").responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not found"):
        _as(client, "globex").responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2,
                                               previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        _as(client, "globex").responses.retrieve(mine.id)
    assert _as(client, "acme").responses.retrieve(mine.id).id == mine.id


def test_structured_text_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL_NAME, input="Answer.", max_output_tokens=20,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"ok"}


@pytest.mark.parametrize("kwargs, says", [
    (dict(input=[{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "text only"),
    (dict(input="x", tools=[{"type": "web_search"}]), "function tools"),
    (dict(input="x", previous_response_id="resp_nope"), "not found"),
    (dict(input="x", text={"format": {"type": "yaml"}}), "text.format"),
    (dict(input="x", extra_body={"max_tokens": 5}), "max_output_tokens"),
    (dict(input="x", extra_body={"n": 2}), "one reply"),
])
def test_what_is_not_served_is_a_400_naming_it(client, kwargs, says):
    with pytest.raises(openai.BadRequestError, match=re.escape(says)):
        client.responses.create(model=MODEL_NAME, max_output_tokens=2, **kwargs)


def test_the_store_is_bounded_in_bytes():
    from portcullis.engine.server.routers.responses import ResponseStore

    store = ResponseStore(limit_bytes=2000)
    for i in range(50):
        store.put("t", {"id": f"r{i}", "pad": "x" * 100}, [{"role": "user", "content": "y" * 100}])
    assert store.get("t", "r0") is None and store.get("t", "r49") is not None
    assert store.get("other", "r49") is None


def test_the_tenants_prompt_cap_holds_for_stored_turns_too(client):
    """The gateway cannot count the turns a previous_response_id brings in: it passes the tenant's
    max_prompt_tokens, and the engine refuses a longer prompt as it renders it."""
    tenant = _as(client, "capped")
    first = tenant.responses.create(model=MODEL_NAME, input="word " * 60, max_output_tokens=2)
    assert first.usage.input_tokens < 100
    capped = tenant.with_options(default_headers={"x-portcullis-tenant": "capped",
                                                  "x-portcullis-max-prompt-tokens": "100"})
    assert capped.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="limit here is 100"):
        capped.responses.create(model=MODEL_NAME, input="word " * 60, max_output_tokens=2,
                                previous_response_id=first.id)
