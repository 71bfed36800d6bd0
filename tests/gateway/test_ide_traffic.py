"""IDE-assistant traffic through the gateway (issue 15, item 5): /v1/embeddings bounded and
charged like prompts, a fill-in-the-middle `suffix` hashed and counted like the prompt, tool
calls counted (never their arguments) in the audit line, streams still streamed."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from portcullis.gateway.upstream.sse import SseRelay

from .conftest import base_policy

EMBEDDINGS = "/v1/embeddings"


def _policy(**defaults):
    policy = base_policy()
    policy["routes"].append({"method": "POST", "path": EMBEDDINGS})
    policy["defaults"].update(defaults)
    return policy


async def _post(gw, path, body, who="alice"):
    async with gw.client() as client:
        return await gw.call(client, "POST", path, json=body, headers=gw.auth(who))


def _fingerprint(gw, text: str) -> str:
    """What the audit line holds for `text`: an HMAC under the gateway's fingerprint key."""
    return gw.app.state.gateway.keyring.fingerprint(text.encode())


# ---- embeddings ---------------------------------------------------------------------------

async def test_embeddings_is_unreachable_unless_the_policy_lists_it(gw, stub):
    response, record = await _post(gw, EMBEDDINGS, {"model": "demo", "input": "hi"})
    assert response.status_code == 404 and record["reason"] == "route_not_allowed" and stub.requests == []


@pytest.mark.parametrize("given,inputs", [("def f(): pass", 1), (["a b", "c"], 2), ([1, 2, 3], 1),
                                          ([[1, 2], [3]], 2)])
async def test_each_input_shape_is_forwarded_as_sent_and_charged_from_usage(gateways, stub, given, inputs):
    gw = gateways.start(_policy())
    body = {"model": "demo", "input": given, "encoding_format": "float", "dimensions": 8}
    response, record = await _post(gw, EMBEDDINGS, body)
    assert response.status_code == 200, response.text
    assert [len(d["embedding"]) for d in response.json()["data"]] == [8] * inputs
    assert stub.requests[-1]["body"] == body  # no max_tokens, salt, stream_options or priority added
    usage = response.json()["usage"]
    assert record["route"] == EMBEDDINGS and record["prompt_tokens"] == usage["prompt_tokens"]
    text = given if isinstance(given, str) else json.dumps(given, sort_keys=True)
    assert record["prompt_hmac"] == _fingerprint(gw, text) != hashlib.sha256(text.encode()).hexdigest()
    assert "tokens_estimated" in record and record["tokens_estimated"] is False


async def test_the_input_text_is_hashed_not_logged(gateways):
    gw = gateways.start(_policy())
    await _post(gw, EMBEDDINGS, {"model": "demo", "input": ["the secret plan"]})
    assert "secret plan" not in gw.audit_text()


@pytest.mark.parametrize("given", [[], ["a", 1], [[]], [["a"]], {"a": 1}, 3, [[1], 2], [True]])
async def test_malformed_input_is_refused_naming_it(gateways, stub, given):
    gw = gateways.start(_policy())
    response, record = await _post(gw, EMBEDDINGS, {"model": "demo", "input": given})
    assert response.status_code == 400 and record["reason"] == "malformed_request"
    assert response.json()["error"]["param"] == "input" and stub.requests == []


async def test_embeddings_are_not_streamed(gateways, stub):
    gw = gateways.start(_policy())
    response, _ = await _post(gw, EMBEDDINGS, {"model": "demo", "input": "x", "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream" and stub.requests == []


async def test_inputs_per_request_are_capped_like_prompts(gateways, stub):
    gw = gateways.start(_policy())
    response, record = await _post(gw, EMBEDDINGS, {"model": "demo", "input": ["x"] * 17})
    assert response.status_code == 400 and record["reason"] == "over_request_cap"
    error = response.json()["error"]
    assert error["param"] == "input" and "max_prompts_per_request" in error["message"] and stub.requests == []
    gw2 = gateways.start(_policy(max_prompts_per_request=64), name="more")
    assert (await _post(gw2, EMBEDDINGS, {"model": "demo", "input": ["x"] * 64}))[0].status_code == 200


async def test_each_input_is_held_to_max_prompt_tokens(gateways, stub):
    gw = gateways.start(_policy(max_prompt_tokens=100))
    ok, _ = await _post(gw, EMBEDDINGS, {"model": "demo", "input": ["short"] * 16})
    assert ok.status_code == 200 and [r["path"] for r in stub.requests] == [EMBEDDINGS]  # nothing to count
    long = "word " * 150
    response, record = await _post(gw, EMBEDDINGS, {"model": "demo", "input": ["short", long]})
    assert response.status_code == 400 and record["reason"] == "prompt_too_long"
    assert response.json()["error"]["param"] == "input"
    counted = [r["body"] for r in stub.requests if r["path"] == "/tokenize"]
    assert counted == [{"model": "demo", "prompt": long}]  # only the input that could be too long
    response, _ = await _post(gw, EMBEDDINGS, {"model": "demo", "input": [[1] * 10, [1] * 101]})
    assert response.status_code == 400 and len(counted) == 1  # token ids need no counting


def _tpm_policy(limit: int = 1000):
    policy = _policy()
    policy["tenants"]["acme"]["limits"] = {"tokens_per_minute": limit}
    return policy


async def test_tokens_per_minute_counts_input_tokens(gateways, stub):
    if time.time() % 60 > 52:  # the sliding window weighs the minute before: keep to one minute
        time.sleep(60.5 - time.time() % 60)
    gw = gateways.start(_tpm_policy())
    response, record = await _post(gw, EMBEDDINGS, {"model": "demo", "input": ["one two three", "four"]})
    assert response.status_code == 200 and record["prompt_tokens"] == 6  # the stub's count
    held = response.headers["x-ratelimit-remaining-tokens"]  # after its estimate was reserved
    # The estimate (a token per 4 bytes) is held before the engine sees anything.
    response, record = await _post(gw, EMBEDDINGS, {"model": "demo", "input": ["x" * 4400]})
    assert response.status_code == 429 and record["reason"] == "token_rate_limit"
    assert [r["path"] for r in stub.requests] == [EMBEDDINGS]
    # The same request again holds the same estimate: the remainder moved by what the first used.
    again, _ = await _post(gw, EMBEDDINGS, {"model": "demo", "input": ["one two three", "four"]})
    assert int(held) - int(again.headers["x-ratelimit-remaining-tokens"]) == 6  # settled to the engine's usage


# ---- fill-in-the-middle -------------------------------------------------------------------

FIM = {"model": "demo", "prompt": "def add(a, b):\n    ", "suffix": "\n    return total\n", "max_tokens": 8}


async def test_a_suffix_is_hashed_beside_the_prompt_and_logged_only_when_prompts_are(gateways, stub):
    gw = gateways.start()
    response, record = await _post(gw, "/v1/completions", FIM)
    assert response.status_code == 200 and stub.requests[-1]["body"]["suffix"] == FIM["suffix"]
    assert record["suffix_hmac"] == _fingerprint(gw, FIM["suffix"])
    assert record["prompt_hmac"] == _fingerprint(gw, FIM["prompt"])
    assert "suffix" not in record and "return total" not in gw.audit_text()
    policy = base_policy()
    policy["audit"]["log_prompts"] = True
    gw2 = gateways.start(policy, name="logs-prompts")
    _, record = await _post(gw2, "/v1/completions", FIM)
    assert record["suffix"] == FIM["suffix"] and record["prompt"] == FIM["prompt"]


async def test_no_suffix_or_an_empty_one_adds_nothing(gw):
    _, record = await _post(gw, "/v1/completions", {**FIM, "suffix": ""})
    assert "suffix_hmac" not in record


async def test_a_suffix_must_be_a_string(gw, stub):
    response, _ = await _post(gw, "/v1/completions", {**FIM, "suffix": ["x"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix" and stub.requests == []


async def test_the_suffix_counts_toward_the_prompt_cap(gateways, stub):
    policy = base_policy()
    policy["defaults"]["max_prompt_tokens"] = 200
    gw = gateways.start(policy)
    assert (await _post(gw, "/v1/completions", FIM))[0].status_code == 200
    assert [r["path"] for r in stub.requests] == ["/v1/completions"]  # short: nothing to count
    long = "word " * 120  # 121 tokens to the stub's count: under the cap alone, over it twice
    assert (await _post(gw, "/v1/completions", {**FIM, "prompt": long}))[0].status_code == 200
    stub.requests.clear()
    response, record = await _post(gw, "/v1/completions", {**FIM, "prompt": long, "suffix": long})
    assert response.status_code == 400 and record["reason"] == "prompt_too_long"
    # One count of the whole FIM prompt, by the engine that will build it.
    assert [r["body"] for r in stub.requests] == [{"model": "demo", "prompt": long, "suffix": long}]
    assert "246 tokens" in response.json()["error"]["message"]  # 121 + 121 + the FIM markers


async def test_the_suffix_counts_toward_the_token_reservation(gateways, tmp_path):
    from .test_proxy import _reply
    from .test_upstream_transport import RawServer

    body = {"model": "demo", "prompt": "x" * 40, "suffix": "y" * 40, "max_tokens": 50}
    async with RawServer(str(tmp_path / "raw.sock"), [_reply(b'{"id":"x","choices":[]}')]) as server:
        gw = gateways.start(_tpm_policy(), engine_url=f"unix://{server.path}")
        response, record = await _post(gw, "/v1/completions", body)
    assert response.status_code == 200 and record["tokens_estimated"] is True
    assert (record["prompt_tokens"], record["completion_tokens"]) == (20, 50)  # 80 bytes of prompt


# ---- tool calls -----------------------------------------------------------------------------

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "look it up"}], "max_tokens": 3,
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]}


async def test_a_reply_with_tool_calls_is_audited_with_their_count_only(gw, stub):
    response, record = await _post(gw, "/v1/chat/completions", {**CHAT, "stub_tool_calls": 2})
    assert [c["function"]["arguments"] for c in response.json()["choices"][0]["message"]["tool_calls"]] == [
        '{"q": "x0"}', '{"q": "x1"}']
    assert record["tool_calls"] == 2 and '\\"x0\\"' not in gw.audit_text() and "lookup" not in gw.audit_text()
    _, record = await _post(gw, "/v1/chat/completions", CHAT)
    assert "tool_calls" not in record  # none made: nothing said


async def test_a_streamed_reply_counts_distinct_calls_and_stays_a_stream(gw, stub):
    stub.chunk_delay_s = 0.15
    body = {**CHAT, "stream": True, "stub_tool_calls": 3}
    async with gw.client() as client:
        started = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=gw.auth()) as response:
            chunks = response.aiter_raw()
            first = await anext(chunks)
            first_at = time.monotonic() - started
            rest = b"".join([chunk async for chunk in chunks])
    assert b"tok0" in first and time.monotonic() - started - first_at > 0.15  # not held back
    events = [json.loads(e[6:]) for e in (first + rest).decode().split("\n\n") if e.startswith("data: {")]
    deltas = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls", [])]
    assert len(deltas) == 9 and {d["index"] for d in deltas} == {0, 1, 2}  # relayed whole
    [record] = await gw.wait_audit(1)
    assert record["tool_calls"] == 3 and record["completion_tokens"] == 3


def _event(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _call(choice: int, index: int, **function) -> dict:
    return {"choices": [{"index": choice, "delta": {"tool_calls": [{"index": index, "function": function}]}}]}


def test_the_relay_counts_calls_across_choices_and_split_chunks():
    relay = SseRelay(strip_usage_chunk=True)
    stream = b"".join([
        _event({"choices": [{"index": 0, "delta": {"content": 'say "name"'}, "tool_calls": None}], "usage": None}),
        _event({"choices": [{"index": 0, "delta": {"tool_calls": []}}]}),
        _event(_call(0, 0, name="a", arguments="")),
        _event(_call(1, 0, name="b", arguments="")),
        _event(_call(0, 0, arguments='{"name": 1}')),  # a later delta: only arguments
        _event(_call(0, 0, name="a")),  # a server that names it again: still one call
        _event(_call(0, 1, name="c", arguments="{}")),
        _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        b"data: [DONE]\n\n",
    ])
    out = b"".join(relay.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + relay.flush()
    assert relay.tool_calls == 3 and relay.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    assert out == stream.replace(_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}), b"")


async def test_an_empty_token_id_prefix_still_counts_its_suffix(gateways, stub):
    """`prompt: [[]]` with a long suffix was counted as 0 tokens (the suffix was only added to
    prefixes with tokens): a review found the whole suffix passing any max_prompt_tokens."""
    policy = base_policy()
    policy["defaults"]["max_prompt_tokens"] = 200
    gw = gateways.start(policy)
    response, record = await _post(gw, "/v1/completions", {**FIM, "prompt": [[]], "suffix": "word " * 300})
    assert response.status_code == 400 and record["reason"] == "prompt_too_long"
