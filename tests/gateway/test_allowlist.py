"""Route allowlist: normalisation rules, and over HTTP, that no spelling of a path reaches
an engine route the policy does not list (and that listed ones are forwarded canonically)."""

from __future__ import annotations

import pytest

from portcullis.gateway.allowlist import model_in_path, normalise_path

from .conftest import base_policy

NORMALISE = [
    (b"/v1/models", "/v1/models"),
    (b"//v1//models/", "/v1/models"),
    (b"/V1/Models", "/v1/models"),
    (b"/%761/models", "/v1/models"),
    (b"/v1/../pause", "/pause"),
    (b"/v1/./models", "/v1/models"),
    (b"/../../v1/models", "/v1/models"),
    (b"/v1%2fmodels", "/v1/models"),
    (b"/v1/%2e%2e/pause", "/pause"),
    (b"/v1/%252e%252e/pause", None),  # double encoding
    (b"/v1/models%00", None),
    (b"/v1\\models", None),
    (b"/v1/%ff", None),  # not UTF-8
]


@pytest.mark.parametrize("raw,expected", NORMALISE)
def test_normalise(raw, expected):
    assert normalise_path(raw) == expected


HTTP_CASES = [
    # (method, raw path, expected status, engine path it may reach)
    ("GET", "/v1/models", 200, "/v1/models"),
    ("GET", "//v1/models", 200, "/v1/models"),
    ("GET", "/V1/models", 200, "/v1/models"),
    ("GET", "/v1/models/", 200, "/v1/models"),
    ("POST", "/%761/completions", 200, "/v1/completions"),
    ("POST", "/v1/../pause", 404, None),
    ("POST", "/v1/%2e%2e/pause", 404, None),
    ("POST", "/pause", 404, None),
    ("GET", "/version", 404, None),
    ("GET", "/metrics", 404, None),  # listed for the admin scope only
    ("DELETE", "/v1/models", 404, None),
    ("GET", "/v1/completions", 404, None),
    ("GET", "/docs", 404, None),
    ("GET", "/openapi.json", 404, None),
    ("GET", "/v1/%252e%252e/pause", 404, None),
]


@pytest.mark.parametrize("method,path,status,engine_path", HTTP_CASES, ids=[f"{c[0]} {c[1]}" for c in HTTP_CASES])
async def test_allowlist_over_http(gw, stub, method, path, status, engine_path):
    body = {"model": "demo", "prompt": "x", "max_tokens": 1} if method == "POST" else None
    async with gw.client() as client:
        response, record = await gw.call(client, method, gw.raw(path), json=body, headers=gw.auth())
    assert response.status_code == status, response.text
    reached = [r["path"] for r in stub.requests]
    if engine_path is None:
        assert reached == []
        assert response.json() == {"error": {"message": "Not found.", "type": "not_found_error",
                                             "param": None, "code": "route_not_allowed"}}
        assert record["decision"] == "denied"
    else:
        assert reached == [engine_path]
        assert record["route"] == engine_path


async def test_unlisted_route_is_404_even_without_credentials(gw, stub):
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/pause")
    assert response.status_code == 404 and record["reason"] == "route_not_allowed"


async def test_admin_scope_reaches_engine_metrics(gw, stub):
    async with gw.client() as client:
        response, record = await gw.call(client, "GET", "/metrics", headers=gw.auth("root"))
    assert response.status_code == 200 and "vllm:num_requests_running" in response.text
    assert [r["path"] for r in stub.requests] == ["/metrics"]


async def test_one_model_card_is_the_listing_narrowed(gw, stub):
    # client.models.retrieve(id): forwarded when the principal may use the model, refused as a
    # request naming it would be (403 here) when it may not, and audited with the model asked for.
    async with gw.client() as client:
        ok, record = await gw.call(client, "GET", "/v1/models/demo", headers=gw.auth("bob"))
        assert ok.status_code == 200 and ok.json()["id"] == "demo"
        assert record["route"] == "/v1/models/{model}" and record["model"] == "demo"
        refused, record = await gw.call(client, "GET", "/v1/models/other", headers=gw.auth("bob"))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
        assert record["decision"] == "denied" and record["model"] == "other"
    assert [r["path"] for r in stub.requests] == ["/v1/models/demo"]


async def test_a_hidden_model_card_reads_like_a_missing_one(gateways, stub):
    policy = base_policy()
    policy["hide_unknown_models"] = True
    gw = gateways.start(policy)
    async with gw.client() as client:
        hidden, record = await gw.call(client, "GET", "/v1/models/other", headers=gw.auth("bob"))
        assert hidden.status_code == 404 and record["reason"] == "model_not_found"
        # Case and slashes of Hub-style ids reach the engine as written (carol may use any model).
        unknown, _ = await gw.call(client, "GET", "/v1/models/Qwen/Qwen2.5-0.5B", headers=gw.auth("carol"))
        assert unknown.status_code == 404
        # A model hidden from the caller reads exactly like one the engine does not have.
        assert hidden.json()["error"] == {**unknown.json()["error"],
                                          "message": "The model `other` does not exist."}
        assert unknown.json()["error"]["message"] == "The model `Qwen/Qwen2.5-0.5B` does not exist."
        anonymous, _ = await gw.call(client, "GET", "/v1/models/demo")
        assert anonymous.status_code == 401
    assert [r["path"] for r in stub.requests] == ["/v1/models/Qwen/Qwen2.5-0.5B"]


MODEL_PATHS = [
    (b"/v1/models/demo", "demo"),
    (b"/v1/models/Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"),  # case kept, a slash allowed
    (b"//V1/Models/demo/", "demo"),
    (b"/v1/models/Qwen%2FQwen2.5", "Qwen/Qwen2.5"),
    (b"/v1/models", None),
    (b"/v1/models/", None),
    (b"/v1/models/demo/../other", None),  # dot segments: the id would not be what was resolved
    (b"/v1/models/./demo", None),
    (b"/v1/models/%2e%2e/pause", None),
    (b"/v1/models/%252e%252e", None),  # double encoding
    (b"/v1/completions", None),
]


@pytest.mark.parametrize("raw,expected", MODEL_PATHS)
def test_model_in_path(raw, expected):
    assert model_in_path(raw) == expected


@pytest.mark.parametrize("path", ["/v1/models/%2e%2e/pause", "/v1/models/%252e%252e", "/v1/models/demo%00"])
async def test_model_card_paths_with_tricks_are_404(gw, stub, path):
    async with gw.client() as client:
        response, record = await gw.call(client, "GET", gw.raw(path), headers=gw.auth("carol"))
    assert response.status_code == 404 and record["reason"] == "route_not_allowed"
    assert stub.requests == []
