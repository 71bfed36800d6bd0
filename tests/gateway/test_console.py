"""The console's JSON API (gateway.console): only a principal with the console's scope sees
anything of it; it finds a refused request by tenant and reason, verifies the chain with the
same code as `portcullis audit verify` (and sees an edited line), totals usage, refuses bad
queries with OpenAI's error body, and audits every call."""
from __future__ import annotations

import asyncio
import json

import pytest

API = "/gateway/console/api"


async def _traffic(gw, client) -> None:
    """Two served completions for alice (acme), one refused model for carol (globex)."""
    for _ in range(2):
        response, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "hi"},
                                    headers=gw.auth("alice"))
        assert response.status_code == 200
    refused, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "nope", "prompt": "x"},
                               headers=gw.auth("bob"))
    assert refused.status_code == 403


@pytest.mark.parametrize("endpoint", ["audit", "verify", "usage", "keys", "policy", "fleet", "nothing-here"])
async def test_only_the_console_scope_sees_anything_of_it(gw, endpoint):
    async with gw.client() as client:
        plain, plain_line = await gw.call(client, "GET", f"{API}/{endpoint}", headers=gw.auth("alice"))
        anonymous, _ = await gw.call(client, "GET", f"{API}/{endpoint}")
        admin, admin_line = await gw.call(client, "GET", f"{API}/{endpoint}", headers=gw.auth("root"))
    assert plain.status_code == 404 and "console" not in plain.text
    assert anonymous.status_code == 401 and "console" not in anonymous.text
    assert plain_line["decision"] == "denied" and plain_line["route"] == "/gateway/console/*"
    if endpoint == "nothing-here":
        assert admin.status_code == 404
    else:
        assert admin.status_code == 200 and admin.headers["cache-control"] == "no-store"
        assert admin_line["route"] == f"{API}/{endpoint}" and admin_line["decision"] == "allowed"
        assert admin_line["principal"] == "root"


async def test_a_refused_request_is_found_by_tenant_and_reason(gw):
    async with gw.client() as client:
        await _traffic(gw, client)
        found, _ = await gw.call(client, "GET", f"{API}/audit",
                                 params={"tenant": "acme", "reason": "model_not_allowed"}, headers=gw.auth("root"))
        newest, _ = await gw.call(client, "GET", f"{API}/audit", params={"limit": "2", "status": "2xx", "model": "demo"},
                                  headers=gw.auth("root"))
    body = found.json()
    assert body["matched"] == 1 and len(body["records"]) == 1
    line = body["records"][0]
    assert (line["principal"], line["model"], line["status"], line["decision"]) == ("bob", "nope", 403, "denied")
    served = newest.json()
    assert served["matched"] == 2 and [r["status"] for r in served["records"]] == [200, 200]
    assert found.json() == (await _search(gw, {"route": "/v1/completions", "reason": "model_not_allowed"}))
    assert served["records"][0]["time"] >= served["records"][1]["time"]  # newest first


async def test_the_chain_reads_verified_then_tampered_after_an_edit(gw):
    async with gw.client() as client:
        await _traffic(gw, client)
        before, _ = await gw.call(client, "GET", f"{API}/verify", headers=gw.auth("root"))
        gw.gateway.audit.flush()
        lines = gw.audit_path.read_text().splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if '"nope"' in line)
        lines[at] = lines[at].replace('"nope"', '"demo"')  # a reviewer's copy of history, rewritten
        gw.audit_path.write_text("".join(lines))
        after = await client.get(f"{API}/verify", headers=gw.auth("root"))
    verified, tampered = before.json(), after.json()
    assert verified["status"] == "verified" and verified["problems"] == [] and verified["keyed_lines"] >= 3
    assert tampered["status"] == "tampered" and tampered["first_bad"].endswith(f":{at + 1}")


async def test_usage_totals_tokens_per_tenant_principal_and_model(gw):
    async with gw.client() as client:
        await _traffic(gw, client)
        response, _ = await gw.call(client, "GET", f"{API}/usage", params={"by": "tenant,model"},
                                    headers=gw.auth("root"))
    served = [r for r in gw.audit_records() if r.get("route") == "/v1/completions" and r["decision"] == "allowed"]
    body = response.json()
    rows = {(r["tenant"], r["model"]): r for r in body["rows"]}
    demo = rows[("acme", "demo")]
    assert demo["requests"] == 2 and demo["denied"] == 0
    assert demo["prompt_tokens"] == sum(r["prompt_tokens"] for r in served) > 0
    assert demo["completion_tokens"] == sum(r["completion_tokens"] for r in served) > 0
    assert rows[("acme", "nope")]["denied"] == 1 and body["by"] == ["tenant", "model"]


async def _search(gw, params: dict) -> dict:
    async with gw.client() as client:
        return (await client.get(f"{API}/audit", params=params, headers=gw.auth("root"))).json()


async def test_keys_are_listed_without_secrets_with_their_state(gw):
    async with gw.client() as client:
        response, _ = await gw.call(client, "GET", f"{API}/keys", headers=gw.auth("root"))
    listed = {k["id"]: k for k in response.json()["keys"]}
    assert set(listed) == set(gw.gateway.store.current.keys)
    for secret in gw.keys.values():
        key_id = secret.split(".")[0].removeprefix("ptc_")
        assert listed[key_id]["principal"] == gw.gateway.store.current.keys[key_id].principal
        assert listed[key_id]["state"] == "active"
        assert secret.split(".")[1] not in response.text
    assert "hmac-sha256" not in response.text and "hash" not in next(iter(listed.values()))


async def test_policy_shows_its_generation_and_a_refused_edit(gw):
    async with gw.client() as client:
        before, _ = await gw.call(client, "GET", f"{API}/policy", headers=gw.auth("root"))
        gw.policy_path.write_text("routes: [not, a, policy\n")
        assert not gw.gateway.store.reload()
        after, _ = await gw.call(client, "GET", f"{API}/policy", headers=gw.auth("root"))
    assert before.json()["reload_refused"] is False and before.json()["refused_edit"] is None
    refused = after.json()
    assert refused["reload_refused"] is True and refused["generation"] == before.json()["generation"]
    assert refused["refused_edit"].startswith(str(gw.policy_path) + ":1")


async def test_fleet_shows_the_engine_and_its_health(gw):
    async with gw.client() as client:
        response, _ = await gw.call(client, "GET", f"{API}/fleet", headers=gw.auth("root"))
    (replica,) = response.json()["replicas"]
    assert replica["healthy"] is True and replica["in_flight"] == 0 and replica["url"].startswith(("unix:", "http"))


@pytest.mark.parametrize("endpoint,params,param", [
    ("audit", {"limit": "0"}, "limit"),
    ("audit", {"limit": "1001"}, "limit"),
    ("audit", {"limit": "ten"}, "limit"),
    ("audit", {"since": "yesterday"}, "since"),
    ("audit", {"tenant": "x" * 201}, "tenant"),
    ("usage", {"period": "week"}, "period"),
    ("usage", {"by": "tenant,secret"}, "by"),
    ("usage", {"by": "tenant,tenant"}, "by"),
])
async def test_a_bad_query_is_a_clear_400(gw, endpoint, params, param):
    async with gw.client() as client:
        response, line = await gw.call(client, "GET", f"{API}/{endpoint}", params=params, headers=gw.auth("root"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_console_query" and param in error["message"]
    assert line["decision"] == "denied" and line["reason"] == "invalid_console_query"


async def test_console_reads_do_not_hold_up_the_proxy(gw, monkeypatch):
    """A slow read of a large log runs in the console's own thread: completions keep flowing."""
    from portcullis.gateway.console import reads as console

    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_audit(gateway, params):
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=10)
        return {"matched": 0, "records": []}

    monkeypatch.setitem(console.ENDPOINTS, "audit", slow_audit)
    async with gw.client() as client:
        reading = asyncio.create_task(client.get(f"{API}/audit", headers=gw.auth("root")))
        await asyncio.sleep(0.1)
        served = await client.post("/v1/completions", json={"model": "demo", "prompt": "hi"}, headers=gw.auth())
        assert served.status_code == 200 and not reading.done()
        release.set()
        assert (await reading).status_code == 200


def _basic(secret: str) -> dict[str, str]:
    import base64

    return {"authorization": "Basic " + base64.b64encode(f"admin:{secret}".encode()).decode()}


@pytest.mark.parametrize("path,media", [("/gateway/console", "text/html"),
                                        ("/gateway/console/static/console.js", "text/javascript"),
                                        ("/gateway/console/static/console.css", "text/css")])
async def test_pages_need_the_scope_and_carry_a_strict_policy(gw, path, media):
    async with gw.client() as client:
        anonymous, _ = await gw.call(client, "GET", path)
        plain, _ = await gw.call(client, "GET", path, headers=_basic(gw.keys["alice"]))
        page, line = await gw.call(client, "GET", path, headers=_basic(gw.keys["root"]))
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Basic ")
    assert plain.status_code == 404 and "console" not in plain.text.lower()
    assert page.status_code == 200 and page.headers["content-type"].startswith(media)
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
    assert line["route"] == path and line["principal"] == "root"
    if media == "text/html":  # no inline script or style, nothing from elsewhere
        html = page.text
        assert "<script>" not in html and "<style" not in html and " style=" not in html and "on" + "click=" not in html
        assert "http://" not in html.replace('xmlns="http://www.w3.org', "") and "https://" not in html
        assert 'src="/gateway/console/static/console.js"' in html


@pytest.mark.parametrize("headers", [{"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"},
                                     {"origin": "https://evil.example"}])
async def test_a_cross_site_request_gets_nothing_even_with_the_admin_key(gw, headers):
    async with gw.client() as client:
        page, line = await gw.call(client, "GET", "/gateway/console", headers={**_basic(gw.keys["root"]), **headers})
        data, _ = await gw.call(client, "GET", f"{API}/audit", headers={**gw.auth("root"), **headers})
    assert page.status_code == data.status_code == 404
    assert "console" not in page.text.lower() and "records" not in data.text
    assert line["decision"] == "denied" and line["reason"] == "route_not_allowed"


async def test_a_same_origin_fetch_is_served(gw):
    async with gw.client() as client:
        host = client.base_url.netloc.decode()
        response, _ = await gw.call(client, "GET", f"{API}/policy", headers={
            **_basic(gw.keys["root"]), "sec-fetch-site": "same-origin", "origin": f"http://{host}"})
    assert response.status_code == 200 and response.json()["reload_refused"] is False


def _writable_policy() -> dict:
    from .conftest import base_policy

    return {**base_policy(), "console": {"write_scope": "admin"}}


def _key_id(gw, name: str) -> str:
    return gw.keys[name].split(".")[0].removeprefix("ptc_")


async def test_the_console_is_read_only_unless_the_policy_names_a_write_scope(gw):
    async with gw.client() as client:
        refused, line = await gw.call(client, "POST", f"{API}/keys/{_key_id(gw, 'bob')}/revoke",
                                      headers={**gw.auth("root"), "x-portcullis-console": "1"})
        still, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "hi"},
                                 headers=gw.auth("bob"))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "console_read_only"
    assert line["route"] == f"{API}/keys/{{id}}/revoke" and line["decision"] == "denied"
    assert still.status_code == 200


async def test_an_admin_revokes_a_key_and_its_next_request_is_refused(gateways):
    gw = gateways.start(_writable_policy())
    bob = _key_id(gw, "bob")
    async with gw.client() as client:
        unconfirmed, _ = await gw.call(client, "POST", f"{API}/keys/{bob}/revoke", headers=gw.auth("root"))
        plain, _ = await gw.call(client, "POST", f"{API}/keys/{bob}/revoke",
                                 headers={**gw.auth("alice"), "x-portcullis-console": "1"})
        cross, _ = await gw.call(client, "POST", f"{API}/keys/{bob}/revoke", headers={
            **gw.auth("root"), "x-portcullis-console": "1", "sec-fetch-site": "cross-site"})
        missing, _ = await gw.call(client, "POST", f"{API}/keys/000000000000/revoke",
                                   headers={**gw.auth("root"), "x-portcullis-console": "1"})
        before, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "hi"},
                                  headers=gw.auth("bob"))
        revoked, line = await gw.call(client, "POST", f"{API}/keys/{bob}/revoke",
                                      headers={**gw.auth("root"), "x-portcullis-console": "1"})
        after, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "hi"},
                                 headers=gw.auth("bob"))
        again, _ = await gw.call(client, "POST", f"{API}/keys/{bob}/revoke",
                                 headers={**gw.auth("root"), "x-portcullis-console": "1"})
        listed, _ = await gw.call(client, "GET", f"{API}/keys", headers=gw.auth("root"))
    assert unconfirmed.status_code == 403 and unconfirmed.json()["error"]["code"] == "console_write_unconfirmed"
    assert plain.status_code == 404 and cross.status_code == 404
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"
    assert before.status_code == 200
    assert revoked.status_code == 200 and revoked.json()["changed"] is True and line["decision"] == "allowed"
    assert after.status_code == 401
    assert again.status_code == 200 and again.json()["changed"] is False
    assert {k["id"]: k["state"] for k in listed.json()["keys"]}[bob] == "revoked"
    actions = [e for e in gw.gateway_events() if e.get("event") == "admin_action"]
    assert len(actions) == 1  # the second revoke changed nothing and wrote nothing
    action = actions[0]
    assert (action["action"], action["actor"], action["via"], action["key_id"], action["principal"]) == (
        "key_revoked", "root", "console", bob, "bob")
    assert action["diff"]["revoked_at"][0] is None and action["diff"]["revoked_at"][1] == revoked.json()["revoked_at"]
    assert action["request_id"] == line["request_id"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
async def test_an_export_streams_the_filtered_records_and_is_audited(gw, fmt):
    import csv
    import io

    async with gw.client() as client:
        await _traffic(gw, client)
        await gw.call(client, "POST", "/v1/completions", json={"model": "=HYPERLINK(1)", "prompt": "x"},
                      headers=gw.auth("bob"))
        response, line = await gw.call(client, "GET", f"{API}/export", headers=gw.auth("root"),
                                       params={"format": fmt, "tenant": "acme", "decision": "denied"})
    assert response.status_code == 200 and "attachment" in response.headers["content-disposition"]
    if fmt == "jsonl":
        rows = [json.loads(text) for text in response.text.splitlines()]
        models = [r["model"] for r in rows]
    else:
        table = list(csv.DictReader(io.StringIO(response.text)))
        rows, models = table, [r["model"] for r in table]
    assert len(rows) == 2 and models[0] == "nope"
    assert models[1] == ("=HYPERLINK(1)" if fmt == "jsonl" else "'=HYPERLINK(1)")  # no formula in a spreadsheet
    assert line["route"] == f"{API}/export" and line["decision"] == "allowed"
    (action,) = [e for e in gw.gateway_events() if e.get("action") == "audit_exported"]
    assert (action["actor"], action["format"], action["rows"]) == ("root", fmt, 2)
    assert action["filters"] == {"tenant": "acme", "decision": "denied"}


async def test_usage_over_time_budgets_and_key_details(gateways):
    from .conftest import base_policy

    policy = base_policy()
    policy["tenants"]["acme"]["limits"] = {"budgets": {"tokens_per_day": 100_000, "requests_per_month": 500},
                                           "requests_per_minute": 600}
    gw = gateways.start(policy)
    async with gw.client() as client:
        await _traffic(gw, client)
        usage_response, _ = await gw.call(client, "GET", f"{API}/usage", params={"by": "tenant"},
                                          headers=gw.auth("root"))
        spent_response, _ = await gw.call(client, "GET", f"{API}/budgets", headers=gw.auth("root"))
        keys_response, _ = await gw.call(client, "GET", f"{API}/keys", headers=gw.auth("root"))
        fleet_response, _ = await gw.call(client, "GET", f"{API}/fleet", headers=gw.auth("root"))
    lines = gw.audit_records()
    served = [r for r in lines if r["tenant"] == "acme" and r["decision"] != "denied"
              and r["route"] == "/v1/completions"]  # the console's own calls are no usage
    tokens = sum((r.get("prompt_tokens") or 0) + (r.get("completion_tokens") or 0) for r in served)
    usage_body = usage_response.json()
    assert len(usage_body["series"]) == 24  # a UTC day by the hour
    assert sum(b["tokens"] for b in usage_body["series"]) == sum(r["total_tokens"] for r in usage_body["rows"])
    assert sum(b["denied"] for b in usage_body["series"]) == sum(r["denied"] for r in usage_body["rows"]) >= 1
    assert usage_body["refusals_by_reason"] == {"model_not_allowed": 1}
    rows = {(b["name"], b["period"], b["unit"]): b for b in spent_response.json()["budgets"]}
    day = rows[("acme", "day", "tokens")]
    assert day["limit"] == 100_000 and day["used"] == tokens > 0 and day["share"] == round(tokens / 100_000, 4)
    assert rows[("acme", "month", "requests")]["used"] == len(served)
    minute = rows[("acme", "minute", "requests")]  # a rate limit: the last 60 s
    assert minute["limit"] == 600 and minute["used"] == len(served)
    assert not any(b["tenant"] == "globex" for b in rows.values())  # no budget set there
    keys_body = {k["id"]: k for k in keys_response.json()["keys"]}
    alice = keys_body[_key_id(gw, "alice")]
    assert alice["last_used"] == max(r["time"] for r in lines if r.get("key_id") == alice["id"])
    assert keys_body[_key_id(gw, "carol")]["last_used"] is None
    assert alice["limits"]["max_tokens"] == 256 and alice["tenant_limits"]["budgets"]["tokens_per_day"] == 100_000
    assert "prefix_cache_hit_rate" in fleet_response.json()["replicas"][0]


WRITE = {"x-portcullis-console": "1"}


async def test_an_admin_creates_a_key_that_works_at_once_and_is_shown_once(gateways):
    gw = gateways.start(_writable_policy())
    async with gw.client() as client:
        created, line = await gw.call(client, "POST", f"{API}/keys", headers={**gw.auth("root"), **WRITE},
                                      json={"principal": "dave", "tenant": "globex", "note": "ci bot",
                                            "expires_in_days": 30})
        bad_tenant, _ = await gw.call(client, "POST", f"{API}/keys", headers={**gw.auth("root"), **WRITE},
                                      json={"principal": "dave", "tenant": "nowhere"})
        bad_field, _ = await gw.call(client, "POST", f"{API}/keys", headers={**gw.auth("root"), **WRITE},
                                     json={"principal": "dave", "tenant": "globex", "scopes": "admin"})
        token = created.json()["token"]
        served, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "hi"},
                                  headers={"authorization": f"Bearer {token}"})
        listed, _ = await gw.call(client, "GET", f"{API}/keys", headers=gw.auth("root"))
    gw.secrets.append(token)  # the token may appear in the one answer that shows it, nowhere else
    body = created.json()
    assert created.status_code == 200 and token.startswith("ptc_") and "hash" not in body
    assert (body["principal"], body["tenant"], body["note"]) == ("dave", "globex", "ci bot")
    assert served.status_code == 200
    assert bad_tenant.status_code == 400 and "nowhere" in bad_tenant.json()["error"]["message"]
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "scopes"
    assert token not in listed.text and token.split(".")[1] not in gw.audit_text()
    (action,) = [e for e in gw.gateway_events() if e.get("action") == "key_created"]
    assert action["key_id"] == body["id"] and action["diff"]["added"]["principal"] == "dave"
    assert "hash" not in action["diff"]["added"] and line["route"] == f"{API}/keys"


async def test_a_policy_edit_is_checked_saved_applied_and_audited_with_its_diff(gateways):
    gw = gateways.start(_writable_policy())
    async with gw.client() as client:
        current, _ = await gw.call(client, "GET", f"{API}/policy/text", headers=gw.auth("root"))
        text, generation = current.json()["text"], current.json()["generation"]
        edited = text.replace("max_tokens: 256", "max_tokens: 64")
        assert edited != text
        broken = text.replace("tenants:", "tenants:\n  acme: {modles: [demo]}\n  x:", 1)
        checked, _ = await gw.call(client, "POST", f"{API}/policy/check", headers={**gw.auth("root"), **WRITE},
                                   json={"text": broken})
        refused, _ = await gw.call(client, "POST", f"{API}/policy", headers={**gw.auth("root"), **WRITE},
                                   json={"text": broken, "base_generation": generation})
        stale, _ = await gw.call(client, "POST", f"{API}/policy", headers={**gw.auth("root"), **WRITE},
                                 json={"text": edited, "base_generation": generation - 1})
        saved, line = await gw.call(client, "POST", f"{API}/policy", headers={**gw.auth("root"), **WRITE},
                                    json={"text": edited, "base_generation": generation})
        capped, _ = await gw.call(client, "POST", "/v1/completions", headers=gw.auth(),
                                  json={"model": "demo", "prompt": "hi", "max_tokens": 100})
    assert checked.status_code == 200 and checked.json()["valid"] is False
    assert checked.json()["error"].startswith(str(gw.policy_path))  # the real file's name, not a temporary one
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_policy"
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "policy_changed"
    assert saved.status_code == 200 and saved.json() == {"saved": True, "generation": generation + 1}
    assert gw.policy_path.read_text() == edited and not list(gw.policy_path.parent.glob(".console-*"))
    assert capped.status_code == 400 and "max_tokens" in capped.json()["error"]["message"]
    (action,) = [e for e in gw.gateway_events() if e.get("action") == "policy_edited"]
    changed = [row for row in action["diff"].splitlines() if row[:1] in "+-" and not row.startswith(("+++", "---"))]
    assert [row[0] for row in changed] == ["-", "+"]
    assert changed[0].endswith("max_tokens: 256") and changed[1].endswith("max_tokens: 64")
    assert action["generation"] == generation + 1 and line["decision"] == "allowed"


async def test_a_policy_behind_a_link_is_not_edited_from_the_console(gateways):
    gw = gateways.start(_writable_policy())
    real = gw.policy_path.with_name("real-policy.yaml")
    gw.policy_path.rename(real)
    gw.policy_path.symlink_to(real.name)
    async with gw.client() as client:
        text = (await client.get(f"{API}/policy/text", headers=gw.auth("root"))).json()
        refused, _ = await gw.call(client, "POST", f"{API}/policy", headers={**gw.auth("root"), **WRITE},
                                   json={"text": text["text"] + "\n# edited\n", "base_generation": text["generation"]})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "policy_not_editable"


async def test_a_jwt_with_the_admin_scope_opens_the_console_at_the_login_prompt(gw, jwt_keys):
    admin, user = jwt_keys.token(sub="ops", scope="admin"), jwt_keys.token(sub="dave", scope="user")
    async with gw.client() as client:
        page, line = await gw.call(client, "GET", "/gateway/console", headers=_basic(admin))
        data, _ = await gw.call(client, "GET", f"{API}/policy", headers={"authorization": f"Bearer {admin}"})
        plain, _ = await gw.call(client, "GET", "/gateway/console", headers=_basic(user))
    assert page.status_code == 200 and line["principal"] == "ops" and line["auth"] == "jwt"
    assert data.status_code == 200 and plain.status_code == 404


async def test_two_editors_from_one_generation_cannot_overwrite_each_other(gateways):
    gw = gateways.start(_writable_policy())
    async with gw.client() as client:
        current = (await client.get(f"{API}/policy/text", headers=gw.auth("root"))).json()
        first = current["text"].replace("max_tokens: 256", "max_tokens: 128")
        second = current["text"].replace("max_tokens: 256", "max_tokens: 64")
        answers = await asyncio.gather(*(
            client.post(f"{API}/policy", headers={**gw.auth("root"), **WRITE},
                        json={"text": text, "base_generation": current["generation"]})
            for text in (first, second)))
    assert sorted(a.status_code for a in answers) == [200, 409]
    saved = first if answers[0].status_code == 200 else second
    assert gw.policy_path.read_text() == saved


async def test_a_write_with_a_huge_or_broken_body_is_refused_cleanly(gateways):
    gw = gateways.start(_writable_policy())
    async with gw.client() as client:
        huge, _ = await gw.call(client, "POST", f"{API}/policy/check", headers={**gw.auth("root"), **WRITE},
                                content=b'{"text": "' + b"x" * (2 << 20) + b'"}')
        broken, _ = await gw.call(client, "POST", f"{API}/keys", headers={**gw.auth("root"), **WRITE},
                                  content=b'{"principal": ')
        still, _ = await gw.call(client, "GET", f"{API}/policy", headers=gw.auth("root"))
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "malformed_json"
    assert still.status_code == 200 and not list(gw.policy_path.parent.glob(".console-*"))
