"""Route allowlist: normalisation rules, and over HTTP, that no spelling of a path reaches
an engine route the policy does not list (and that listed ones are forwarded canonically)."""

from __future__ import annotations

import pytest

from gateway.allowlist import normalise_path

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
