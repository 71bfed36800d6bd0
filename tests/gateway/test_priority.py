"""Priority from policy (issue 16, item 4): the engine's `priority` (lower runs first) is raised to
the tenant's or principal's; a client may lower its own priority, never raise it past the
policy's; without a policy value the client's passes as sent. The effective value is audited."""

from __future__ import annotations

import pytest

from portcullis.cli import main

from .conftest import base_policy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _policy(tenant: int | None = 10, bob: int | None = None):
    policy = base_policy()
    policy["routes"].append({"method": "POST", "path": "/v1/embeddings"})
    if tenant is not None:
        policy["tenants"]["acme"]["priority"] = tenant
    if bob is not None:
        policy["principals"]["bob"]["priority"] = bob
    return policy


async def _sent(gw, stub, path, body, who="alice"):
    """(the priority the engine received, or None; the audit line)."""
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", path, json=body, headers=gw.auth(who))
    assert response.status_code == 200, response.text
    return stub.requests[-1]["body"].get("priority"), record


@pytest.mark.parametrize("asked,sent", [(None, 10), (0, 10), (-5, 10), (10, 10), (20, 20)])
async def test_a_client_cannot_raise_its_priority_past_the_policys(gateways, stub, asked, sent):
    gw = gateways.start(_policy(tenant=10))
    body = CHAT if asked is None else {**CHAT, "priority": asked}
    priority, record = await _sent(gw, stub, "/v1/chat/completions", body)
    assert priority == sent and record["priority"] == sent


async def test_streamed_and_legacy_completions_get_it_too(gateways, stub):
    gw = gateways.start(_policy(tenant=10))
    priority, _ = await _sent(gw, stub, "/v1/chat/completions", {**CHAT, "stream": True, "priority": 1})
    assert priority == 10
    priority, record = await _sent(gw, stub, "/v1/completions", {"model": "demo", "prompt": "x", "priority": 0})
    assert priority == 10 and record["priority"] == 10


async def test_a_principal_rule_overrides_its_tenant(gateways, stub):
    gw = gateways.start(_policy(tenant=10, bob=0))
    assert (await _sent(gw, stub, "/v1/chat/completions", CHAT, who="bob"))[0] == 0
    assert (await _sent(gw, stub, "/v1/chat/completions", {**CHAT, "priority": -3}, who="bob"))[0] == 0
    assert (await _sent(gw, stub, "/v1/chat/completions", {**CHAT, "priority": 4}, who="bob"))[0] == 4
    assert (await _sent(gw, stub, "/v1/chat/completions", CHAT, who="alice"))[0] == 10  # the tenant's


async def test_without_a_policy_value_the_body_is_left_alone(gateways, stub):
    gw = gateways.start(_policy(tenant=None))
    priority, record = await _sent(gw, stub, "/v1/chat/completions", CHAT)
    assert "priority" not in stub.requests[-1]["body"] and "priority" not in record
    priority, record = await _sent(gw, stub, "/v1/chat/completions", {**CHAT, "priority": -7})
    assert priority == -7 and record["priority"] == -7
    priority, _ = await _sent(gw, stub, "/v1/chat/completions", {**CHAT, "priority": None})
    assert stub.requests[-1]["body"]["priority"] is None  # null is "not set", sent as it came


async def test_only_generation_routes_are_given_a_priority(gateways, stub):
    gw = gateways.start(_policy(tenant=10))
    priority, record = await _sent(gw, stub, "/v1/embeddings", {"model": "demo", "input": "x"})
    assert priority is None and "priority" not in record


async def test_a_priority_that_is_not_an_integer_is_refused(gateways, stub):
    gw = gateways.start(_policy(tenant=10))
    async with gw.client() as client:
        response, _ = await gw.call(client, "POST", "/v1/chat/completions", json={**CHAT, "priority": "0"},
                                    headers=gw.auth())
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority" and stub.requests == []


async def test_a_reload_changes_the_priority(gateways, stub):
    import asyncio

    gw = gateways.start(_policy(tenant=10))
    assert (await _sent(gw, stub, "/v1/chat/completions", CHAT))[0] == 10
    gw.write_policy(_policy(tenant=3))
    for _ in range(100):
        if (await _sent(gw, stub, "/v1/chat/completions", CHAT))[0] == 3:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the reloaded priority was never applied")


def test_policy_check_shows_priorities_and_says_what_the_engine_needs(tmp_path, capsys):
    from .conftest import write_policy_file

    policy = _policy(tenant=10, bob=0)
    del policy["keys_file"], policy["jwt"]
    write_policy_file(tmp_path / "policy.yaml", policy)
    assert main(["policy", "check", str(tmp_path / "policy.yaml")]) == 0
    out = capsys.readouterr().out
    assert "priority 10" in out and "tenants.acme set a priority: start the engine with --scheduling-policy priority" in out
    policy["tenants"]["acme"]["priority"] = "high"
    write_policy_file(tmp_path / "policy.yaml", policy)
    assert main(["policy", "check", str(tmp_path / "policy.yaml")]) == 1
    assert "tenants.acme.priority" in capsys.readouterr().out
