"""Authorisation and request checks: models, max_tokens, body size, JSON, prompt length,
and what the engine receives (cache salt, no client credentials, request id)."""

from __future__ import annotations

import asyncio
import time

import pytest

from portcullis.gateway.upstream.fleet import CARDS_TTL_S
from portcullis.protocol.json_body import MAX_JSON_CONTAINERS

from .conftest import ENGINE_TOKEN, base_policy


async def _complete(gw, body, who="alice", **kw):
    async with gw.client() as client:
        return await gw.call(client, "POST", "/v1/completions", json=body, headers=gw.auth(who), **kw)


MODEL_CASES = [
    ("alice", "demo", 200, "ok"),
    ("alice", "other", 200, "ok"),
    ("alice", "secret-model", 403, "model_not_allowed"),
    ("bob", "other", 403, "model_not_allowed"),  # narrowed by his principal rule
    ("carol", "secret-model", 200, "ok"),  # globex may use any model
]


@pytest.mark.parametrize("who,model,status,reason", MODEL_CASES)
async def test_model_allowlist(gw, stub, who, model, status, reason):
    response, record = await _complete(gw, {"model": model, "prompt": "hi", "max_tokens": 2}, who)
    assert response.status_code == status
    assert record["reason"] == reason and record["model"] == model
    if status != 200:
        assert response.json()["error"]["param"] == "model"
        assert stub.requests == []


async def test_hidden_models_answer_404(gateways, stub):
    policy = base_policy()
    policy["hide_unknown_models"] = True
    gw = gateways.start(policy)
    response, record = await _complete(gw, {"model": "secret-model", "prompt": "hi"})
    assert response.status_code == 404 and record["reason"] == "model_not_found"


async def test_model_is_required_when_the_principal_is_restricted(gw):
    response, record = await _complete(gw, {"prompt": "hi"})
    assert response.status_code == 400 and record["reason"] == "model_required"


async def test_model_list_is_filtered_to_what_the_principal_may_use(gw):
    async with gw.client() as client:
        response, _ = await gw.call(client, "GET", "/v1/models", headers=gw.auth("bob"))
    assert [m["id"] for m in response.json()["data"]] == ["demo"]


async def test_max_tokens_over_cap_is_refused(gw, stub):
    response, record = await _complete(gw, {"model": "demo", "prompt": "hi", "max_tokens": 257})
    assert response.status_code == 400 and record["reason"] == "max_tokens_over_cap"
    assert response.json()["error"]["param"] == "max_tokens"
    assert stub.requests == []



@pytest.mark.parametrize("where,field_path", [(None, "defaults.max_tokens"), ("tenant", "tenants.acme.limits.max_tokens"),
                                              ("principal", "principals.bob.limits.max_tokens")])
async def test_max_tokens_over_cap_names_the_policy_field_to_raise(gateways, stub, where, field_path):
    policy = base_policy()
    if where == "tenant":
        policy["tenants"]["acme"]["limits"] = {"max_tokens": 100}
    if where == "principal":
        policy["principals"]["bob"]["limits"] = {"max_tokens": 100}
    gw = gateways.start(policy)
    response, _ = await _complete(gw, {"model": "demo", "prompt": "hi", "max_tokens": 300}, "bob")
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and f"raise {field_path} in the policy" in message, message


async def test_max_tokens_over_cap_is_clamped_when_policy_says_so(gateways, stub):
    policy = base_policy()
    policy["max_tokens_over_cap"] = "clamp"
    gw = gateways.start(policy)
    response, _ = await _complete(gw, {"model": "demo", "prompt": "hi", "max_completion_tokens": 9999})
    assert response.status_code == 200
    assert stub.requests[-1]["body"]["max_completion_tokens"] == 256


async def test_absent_max_tokens_gets_the_cap(gw, stub):
    await _complete(gw, {"model": "demo", "prompt": "hi"})
    assert stub.requests[-1]["body"]["max_tokens"] == 256


async def test_body_over_limit_is_413(gw, stub):
    big = {"model": "demo", "prompt": "x" * 70_000}
    response, record = await _complete(gw, big)
    assert response.status_code == 413 and record["reason"] == "body_too_large"
    assert stub.requests == []


async def test_chunked_body_over_limit_is_413_without_content_length(gw):
    async def chunks():
        for _ in range(100):
            yield b"x" * 1024

    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", content=chunks(),
                                         headers={**gw.auth(), "content-type": "application/json"})
    assert response.status_code == 413 and record["reason"] == "body_too_large"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
async def test_malformed_json_is_400(gw, raw):
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", content=raw,
                                         headers={**gw.auth(), "content-type": "application/json"})
    assert response.status_code == 400 and record["reason"] == "malformed_json"
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_prompt_over_token_cap_is_refused_after_counting(gateways, stub):
    policy = base_policy()
    policy["defaults"]["max_prompt_tokens"] = 100
    gw = gateways.start(policy)
    response, _ = await _complete(gw, {"model": "demo", "prompt": "short"})
    assert response.status_code == 200
    assert [r["path"] for r in stub.requests] == ["/v1/completions"]  # short: no count needed
    response, record = await _complete(gw, {"model": "demo", "prompt": "word " * 150})
    assert response.status_code == 400 and record["reason"] == "prompt_too_long"
    assert [r["path"] for r in stub.requests][-1] == "/tokenize"


async def test_engine_gets_tenant_salt_internal_token_and_request_id(gw, stub):
    body = {"model": "demo", "prompt": "hi", "cache_salt": "guess-other-tenant"}
    response, _ = await _complete(gw, body)
    seen = stub.requests[-1]
    assert seen["headers"]["authorization"] == f"Bearer {ENGINE_TOKEN}"
    assert gw.keys["alice"] not in str(seen["headers"])
    assert seen["headers"]["x-request-id"] == response.headers["x-request-id"]
    salt_acme = seen["body"]["cache_salt"]
    assert salt_acme not in ("guess-other-tenant", "acme") and len(salt_acme) == 64
    await _complete(gw, body, who="bob")
    assert stub.requests[-1]["body"]["cache_salt"] == salt_acme  # same tenant, same salt
    await _complete(gw, body, who="carol")
    assert stub.requests[-1]["body"]["cache_salt"] != salt_acme


async def test_engine_is_told_whose_turn_each_call_is_without_the_tenants_name(gateways, stub):
    """The engine's tokenizer and grammar threads serve tenants in turn by an opaque tag (issue
    29): one per tenant, on generation and on the gateway's own /tokenize counts, whatever the
    cache scope, never the tenant's name and never what the client sent."""
    policy = base_policy()
    policy["cache_scope"] = "global"
    policy["defaults"]["max_prompt_tokens"] = 100
    gw = gateways.start(policy)
    async with gw.client() as client:
        for who, prompt in (("alice", "word " * 150), ("bob", "hi")):
            await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": prompt},
                          headers={**gw.auth(who), "x-portcullis-tenant": "globex"})
    counted, = [r for r in stub.requests if r["path"] == "/tokenize"]
    acme = counted["headers"]["x-portcullis-tenant"]
    assert stub.requests[-1]["headers"]["x-portcullis-tenant"] == acme
    await _complete(gw, {"model": "demo", "prompt": "hi"}, who="carol")
    globex = stub.requests[-1]["headers"]["x-portcullis-tenant"]
    assert globex != acme and len(acme) == len(globex) == 64
    assert "acme" not in acme and "globex" not in globex


async def test_engine_is_told_the_tenants_prompt_cap(gateways, stub):
    """The engine enforces max_prompt_tokens as it renders the prompt, which covers what the
    gateway cannot count (a Responses call's stored earlier turns)."""
    policy = base_policy()
    policy["defaults"]["max_prompt_tokens"] = 100
    gw = gateways.start(policy)
    await _complete(gw, {"model": "demo", "prompt": "hi"})
    assert stub.requests[-1]["headers"]["x-portcullis-max-prompt-tokens"] == "100"
    uncapped = gateways.start(base_policy(), name="uncapped")
    await _complete(uncapped, {"model": "demo", "prompt": "hi"})
    assert "x-portcullis-max-prompt-tokens" not in stub.requests[-1]["headers"]


async def test_global_cache_scope_leaves_the_salt_alone(gateways, stub):
    policy = base_policy()
    policy["cache_scope"] = "global"
    gw = gateways.start(policy)
    await _complete(gw, {"model": "demo", "prompt": "hi"})
    assert "cache_salt" not in stub.requests[-1]["body"]


async def test_client_request_id_is_kept_beside_the_gateways_own(gw, stub):
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions",
                                         json={"model": "demo", "prompt": "hi"},
                                         headers={**gw.auth(), "x-request-id": "trace-123"})
    assert response.headers["x-request-id"] == record["request_id"] != "trace-123"
    assert response.headers["x-client-request-id"] == "trace-123" == record["client_request_id"]
    assert stub.requests[-1]["headers"]["x-request-id"] == record["request_id"]


async def test_hostile_request_id_is_replaced(gw):
    async with gw.client() as client:
        response, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "hi"},
                                    headers={**gw.auth(), "x-request-id": "a b\"c"})
    assert response.headers["x-request-id"] != 'a b"c'


async def test_prompt_is_hashed_not_logged_unless_policy_asks(gateways):
    gw = gateways.start()
    _, record = await _complete(gw, {"model": "demo", "prompt": "top secret plan"})
    assert "prompt" not in record and len(record["prompt_hmac"]) == 64
    assert "top secret plan" not in gw.audit_text()
    policy = base_policy()
    policy["audit"]["log_prompts"] = True
    gw2 = gateways.start(policy, name="logs-prompts")
    _, record = await _complete(gw2, {"model": "demo", "prompt": "top secret plan"})
    assert record["prompt"] == "top secret plan"


async def test_no_version_banner(gw):
    async with gw.client() as client:
        response, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                    headers=gw.auth())
    assert "server" not in response.headers


async def test_client_hanging_up_mid_body_is_audited_once(gw, stub):
    reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + gw.keys["alice"].encode() + b"\r\ncontent-length: 1000\r\n\r\n{\"mo")
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    records = await gw.wait_audit(1)
    assert len(records) == 1 and records[0]["reason"] == "client_disconnected"
    assert records[0]["decision"] == "failed" and stub.requests == []


async def test_a_key_can_narrow_its_principals_models(gw):
    from portcullis.gateway.auth.keys import KeyBook, new_key

    token, record = new_key("alice", "acme", [], models=["other"])
    KeyBook(gw.folder / "keys.yaml").add(record)
    deadline = time.monotonic() + 2
    while record.id not in gw.gateway.store.current.keys:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    headers = {"authorization": f"Bearer {token}"}
    async with gw.client() as client:
        refused, audit = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                       headers=headers)
        allowed, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "other", "prompt": "x"},
                                   headers=headers)
        listed, _ = await gw.call(client, "GET", "/v1/models", headers=headers)
    assert refused.status_code == 403 and audit["key_id"] == record.id
    assert allowed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["other"]


# ---- strict types, caps and list sizes (issue 13, findings 4, 5, 6, 7, 13) -----------------

CHAT_HI = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _chat(gw, body, who="alice"):
    async with gw.client() as client:
        return await gw.call(client, "POST", "/v1/chat/completions", json=body, headers=gw.auth(who))


@pytest.mark.parametrize("field,value,param", [
    ("stream", 1, "stream"),  # the engine would read 1 as true and stream without being charged
    ("stream", "true", "stream"),
    ("stream_options", {"include_usage": 1}, "stream_options.include_usage"),
    ("stream_options", "yes", "stream_options"),
    ("n", 2.0, "n"),
    ("n", True, "n"),
    ("max_tokens", "4", "max_tokens"),
    ("logprobs", 1, "logprobs"),  # a boolean in chat
    ("top_logprobs", "2", "top_logprobs"),
    ("echo", 1, "echo"),
    ("continue_final_message", "false", "continue_final_message"),
])
async def test_fields_the_gateway_reads_must_have_their_json_type(gw, stub, field, value, param):
    response, record = await _chat(gw, {**CHAT_HI, field: value})
    assert response.status_code == 400 and record["reason"] == "malformed_request"
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"]
    assert stub.requests == []


async def test_null_fields_and_completions_logprobs_as_integer_pass(gw, stub):
    response, _ = await _chat(gw, {**CHAT_HI, "stream": None, "n": None, "logprobs": True, "top_logprobs": 2})
    assert response.status_code == 200
    response, _ = await _complete(gw, {"model": "demo", "prompt": "hi", "logprobs": 2, "max_tokens": 2})
    assert response.status_code == 200
    response, _ = await _complete(gw, {"model": "demo", "prompt": "hi", "logprobs": True, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("extra,param", [
    ({"n": 17}, "n"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": [[1, 2]] * 17}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
async def test_fan_out_over_the_default_caps_is_refused(gw, stub, extra, param):
    response, record = await _complete(gw, {"model": "demo", "prompt": "hi", "max_tokens": 2, **extra})
    assert response.status_code == 400 and record["reason"] == "over_request_cap"
    error = response.json()["error"]
    assert error["param"] == param and "policy" in error["message"]
    assert stub.requests == []


async def test_the_policy_can_raise_the_fan_out_caps(gateways, stub):
    policy = base_policy()
    policy["tenants"]["acme"]["limits"] = {"max_n": 64, "max_prompts_per_request": 32, "max_logprobs": 20}
    gw = gateways.start(policy)
    response, _ = await _complete(gw, {"model": "demo", "prompt": ["a"] * 20, "n": 40, "max_tokens": 2})
    assert response.status_code == 200
    response, _ = await _chat(gw, {**CHAT_HI, "logprobs": True, "top_logprobs": 20})
    assert response.status_code == 200
    response, _ = await _chat(gw, {**CHAT_HI, "n": 65})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


@pytest.mark.parametrize("field,value", [
    ("stop", ["s"] * 17),  # the engine's cap: IDE assistants send a dozen, OpenAI takes 4
    ("stop", "x" * 257),
    ("stop", [1, 2]),
    ("stop_token_ids", list(range(257))),
    ("stop_token_ids", ["1"]),
    ("bad_words", ["w"] * 1025),
    ("bad_words", ["x" * 129]),
    ("allowed_token_ids", list(range(4097))),
    ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
    ("messages", [{"role": "user", "content": "hi"}] * 2049),
    ("guided_choice", ["yes"] * 257),
    ("guided_choice", [1]),
])
async def test_oversized_lists_and_strings_are_refused_naming_the_field(gateways, stub, field, value):
    policy = base_policy()
    policy["defaults"]["max_body_bytes"] = 1024 * 1024
    gw = gateways.start(policy)
    response, record = await _chat(gw, {**CHAT_HI, field: value})
    assert response.status_code == 400 and record["reason"] in ("malformed_request", "over_request_cap")
    assert response.json()["error"]["param"] == field
    assert stub.requests == []


async def test_a_hundred_thousand_deep_json_is_a_400(gateways, stub):
    policy = base_policy()
    policy["defaults"]["max_body_bytes"] = 1024 * 1024
    gw = gateways.start(policy)
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"model":"demo","prompt":"x","x":' + b"[" * 200 + b"]" * 200 + b"}"):
        async with gw.client() as client:
            response, record = await gw.call(client, "POST", "/v1/completions", content=raw,
                                             headers={**gw.auth(), "content-type": "application/json"})
        assert response.status_code == 400 and record["reason"] == "malformed_json"
        assert "deep" in response.json()["error"]["message"] or "arrays and objects" in response.json()["error"]["message"]
    assert stub.requests == []


async def test_a_body_of_many_small_containers_is_refused_before_the_parse(gateways, stub, monkeypatch):
    """Second review, finding 1: 380,000 `[[]]` (1.9 MB) in an extra field held the event loop in
    `json.loads` and the depth walk for seconds. The raw bytes are counted first; brackets in
    strings (a prompt of code) do not count."""
    from portcullis.gateway import body as gateway_body

    policy = base_policy()
    policy["defaults"]["max_body_bytes"] = 4 * 1024 * 1024
    gw = gateways.start(policy)
    parsed = []
    real_loads = gateway_body.json.loads
    monkeypatch.setattr(gateway_body.json, "loads", lambda raw, *a, **k: parsed.append(len(raw)) or real_loads(raw, *a, **k))
    bomb = b'{"model":"demo","prompt":"x","extra":[' + b",".join([b"[[]]"] * 380_000) + b"]}"
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", content=bomb,
                                         headers={**gw.auth(), "content-type": "application/json"})
        assert max(parsed, default=0) < 4096 and response.status_code == 400 and record["reason"] == "malformed_json"
        assert str(MAX_JSON_CONTAINERS) in response.json()["error"]["message"]
        code = "x = [a[i] for i in b[0]] + [{k: v} for k in d]\n" * 4_000  # 20,000 brackets in a string
        response, _ = await gw.call(client, "POST", "/v1/completions", headers=gw.auth(),
                                    json={"model": "demo", "prompt": "x", "max_tokens": 1, "user": code})
        assert response.status_code == 200, response.text
    assert len(stub.requests) == 1


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


async def test_prompt_count_uses_everything_the_chat_template_reads(gateways, stub):
    policy = base_policy()
    policy["defaults"]["max_prompt_tokens"] = 100
    gw = gateways.start(policy)
    body = {**CHAT_HI, "tools": TOOLS, "continue_final_message": True, "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False}}
    response, _ = await _chat(gw, body)
    assert response.status_code == 200
    counted, sent = stub.requests[-2]["body"], stub.requests[-1]["body"]
    assert stub.requests[-2]["path"] == "/tokenize"  # a short prompt with tools is still counted
    assert counted["messages"] == sent["messages"]
    assert counted["continue_final_message"] is True and counted["add_generation_prompt"] is False
    assert counted["tools"] == TOOLS and counted["chat_template_kwargs"] == {"enable_thinking": False}
    stub.requests.clear()
    await _chat(gw, {**body, "tool_choice": "none"})  # not rendered, so not counted either
    assert stub.requests[-2]["path"] == "/tokenize" and "tools" not in stub.requests[-2]["body"]


async def test_lists_within_the_caps_pass(gw, stub):
    body = {**CHAT_HI, "stop": ["\n\n", "```"] * 6, "stop_token_ids": [1, 2], "logit_bias": {"5": -100}}
    response, _ = await _chat(gw, body)
    assert response.status_code == 200 and stub.requests[-1]["body"]["stop"] == body["stop"]


async def test_a_body_in_utf16_is_refused_not_miscounted(gateways, stub):
    """JSON text is UTF-8: json.loads(bytes) takes UTF-16 too, where an escaped quote turns the
    container count's idea of a string inside out (a review found a 3.8 MB bomb passing)."""
    policy = base_policy()
    policy["defaults"]["max_body_bytes"] = 4 * 1024 * 1024
    gw = gateways.start(policy)
    bomb = ('{"model":"demo","prompt":"\\"","x":[' + ",".join(["[[]]"] * 380_000) + '],"c":""}').encode("utf-16")
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", content=bomb,
                                         headers={**gw.auth(), "content-type": "application/json"})
    assert response.status_code == 400 and record["reason"] == "malformed_json"
    assert stub.requests == []


# ---- text no engine could fit (issue 29's noisy neighbour: a 3.6 MB prompt) -------------------

TOO_LONG = [  # the engine's cards below: 2,048 tokens of at most 64 characters, 131,072 characters
    ("/v1/completions", {"prompt": "hello world " * 11_000}, "prompt"),  # 132,000
    ("/v1/completions", {"prompt": ["hi", "x" * 131_000], "suffix": "y" * 100}, "prompt"),  # one sequence's text
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 70_000}]},
                                           {"role": "user", "content": "y" * 70_000}]}, "messages"),
    ("/tokenize", {"prompt": "x" * 131_073}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * 131_073}]}, "messages"),
    ("/v1/embeddings", {"input": ["a", "x" * 131_073]}, "input"),
]
FITS = [  # at the limit, or cut by truncate_prompt_tokens (only the tail is tokenized)
    ("/v1/completions", {"prompt": "x" * 131_072}),
    ("/v1/completions", {"prompt": "x" * 200_000, "truncate_prompt_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200_000}], "truncate_prompt_tokens": 8}),
    ("/v1/embeddings", {"input": "x" * 200_000, "truncate_prompt_tokens": 8}),
]


async def test_text_no_engine_could_fit_is_refused_before_it_is_forwarded(gateways, stub, monkeypatch):
    """Text longer than the engine's context times its longest token (both from its cards)
    cannot fit; the gateway refuses it as the engine would, before encoding and forwarding
    megabytes that slowed every other tenant (tests/reliability/test_noisy_neighbour.py)."""
    monkeypatch.setattr(stub, "max_model_len", 2048)
    monkeypatch.setattr(stub, "max_token_chars", 64)
    policy = base_policy()
    policy["routes"].append({"method": "POST", "path": "/v1/embeddings"})
    policy["defaults"]["max_body_bytes"] = 1 << 20
    gw = gateways.start(policy)
    async with gw.client() as client:
        for path, body, param in TOO_LONG:
            response, record = await gw.call(client, "POST", path, json={"model": "demo", "max_tokens": 1, **body},
                                             headers=gw.auth("alice"))
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == param, (path, error)
            assert "at most 131072" in error["message"] and record["status"] == 400
        assert [r["path"] for r in stub.requests] == ["/v1/models"]  # its cards, read once; nothing forwarded
        for path, body in FITS:
            response, _ = await gw.call(client, "POST", path, json={"model": "demo", "max_tokens": 1, **body},
                                        headers=gw.auth("alice"))
            assert response.status_code == 200 and stub.requests[-1]["path"] == path, (path, response.text)
    # An engine whose cards do not say (an older one) gets the text and refuses it itself.
    monkeypatch.setattr(stub, "max_token_chars", None)
    gw.gateway.fleet.replicas["engine"].cards_read_at -= CARDS_TTL_S
    response, _ = await _complete(gw, {"model": "demo", "max_tokens": 1, **TOO_LONG[0][1]})
    assert response.status_code == 200 and stub.requests[-1]["path"] == "/v1/completions"
