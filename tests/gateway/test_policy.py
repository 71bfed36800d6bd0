"""Policy: validation with file:line:reason, `policy check`, the schema file, hot reload."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import yaml

from portcullis.cli import main
from portcullis.gateway.auth.keys import new_key
from portcullis.gateway.policy.loader import PolicyError, load_policy
from portcullis.gateway.policy.schema import policy_schema

from .conftest import ROOT, base_policy, write_policy_file

EXAMPLE = ROOT / "policies" / "example.yaml"

BAD_POLICIES = [
    # A bracket left open is reported where it opened, not where PyYAML gave up.
    ("yaml error", "routes: [\n  {method: GET, path: /x\n", 2, "the '{' opened on this line is not closed"),
    ("unclosed flow entry", "routes:\n  - {method: GET, path: /x\n  - {method: GET, path: /y}\ntenants: {a: {}}\n", 2,
     "not closed"),
    ("tab indentation", "routes:\n  - {method: GET, path: /x}\ntenants:\n\ta: {}\n", 4, "indent with spaces"),
    ("wrong indentation", "routes:\n  - {method: GET, path: /x}\ntenants:\n  a:\n      models: [x]\n    limits: {}\n",
     6, "check the indentation"),
    ("two documents", "routes:\n  - {method: GET, path: /x}\ntenants: {a: {}}\n---\nx: 1\n", 4, "remove the '---'"),
    ("not utf-8", "tenants: {a: {}}\n# caf\xe9\n", None, "not UTF-8"),
    ("control character", "tenants: {a: {}}\x00\n", None, "control character"),
    ("list as a key", "routes:\n  - {method: GET, path: /x}\ntenants: {a: {}}\n? [1]\n: 2\n", 4, "plain name"),
    ("unknown field", "routes:\n  - {method: GET, path: /v1/models}\ntenants:\n  a:\n    modles: [x]\n", 5,
     "tenants.a.modles: unknown field; did you mean 'models'?"),
    ("unknown block field", "routes:\n  - {method: GET, path: /v1/models}\ntenants:\n  a:\n    limits:\n"
     "      request_per_minute: 5\n", 6, "did you mean 'requests_per_minute'?"),
    ("stray top-level key", "routes:\n  - {method: GET, path: /v1/models}\ntenants: {a: {}}\nresearch:\n  models: [x]\n",
     4, "research: unknown field; expected one of: version, routes, tenants"),
    ("duplicate yaml key", "routes:\n  - {method: GET, path: /v1/models}\ntenants:\n  a: {}\n  a: {}\n", 5,
     "duplicate key 'a'"),
    ("bad limit", "routes:\n  - {method: GET, path: /v1/models}\ntenants:\n  a:\n    limits:\n"
     "      requests_per_minute: -1\n", 6, "tenants.a.limits.requests_per_minute"),
    ("wrong type", "routes:\n  - {method: GET, path: /v1/models}\ntenants:\n  a:\n    limits:\n"
     "      requests_per_minute: lots\n", 6, "valid integer, unable to parse string as an integer (got 'lots')"),
    ("non-canonical route", "routes:\n  - {method: GET, path: /V1/Models/}\ntenants: {a: {}}\n", 2,
     "must be lower-case"),
    ("duplicate route", "routes:\n  - {method: GET, path: /x}\n  - {method: GET, path: /x}\ntenants: {a: {}}\n", 3,
     "routes.1: route GET /x is already listed as routes.0"),
    ("unknown tenant", "routes:\n  - {method: GET, path: /x}\ntenants: {a: {}}\nprincipals:\n"
     "  p: {tenant: b}\n", 5, "principals.p.tenant: tenant 'b' is not defined under tenants: (defined: a)"),
    ("jwt default tenant", "routes:\n  - {method: GET, path: /x}\ntenants: {a: {}}\njwt:\n  algorithms: [RS256]\n"
     "  issuer: i\n  audience: a\n  jwks_file: j.json\n  default_tenant: b\n", 9, "tenant 'b' is not defined"),
    ("jwt missing issuer", "routes:\n  - {method: GET, path: /x}\ntenants: {a: {}}\njwt:\n  algorithms: [RS256]\n"
     "  audience: a\n  jwks_file: j.json\n", 4, "jwt: missing required field 'issuer'"),
    ("jwt without keys", "routes:\n  - {method: GET, path: /x}\ntenants: {a: {}}\njwt:\n  algorithms: [RS256]\n"
     "  issuer: i\n  audience: a\n", 4, "need jwks_file or jwks_url"),
    ("not a mapping", "- just\n- a list\n", 1, "must be a YAML mapping"),
    # A mistyped URL is echoed without the password it carries (the message reaches the log).
    ("storage url with a password", "routes:\n  - {method: GET, path: /x}\ntenants: {a: {}}\nrate_limits:\n"
     "  storage: 'redis//:S3cretPassw0rd@redis:6379/0'\n", 5, "(got '…@redis:6379/0')"),
    ("open engine metrics", "routes:\n  - {method: GET, path: /v1/models}\n  - {method: GET, path: /metrics}\n"
     "tenants: {a: {}}\n", 3, "list it with scopes"),
]


@pytest.mark.parametrize("case,text,line,reason", BAD_POLICIES, ids=[c[0] for c in BAD_POLICIES])
def test_invalid_policy_names_file_line_and_reason(tmp_path, case, text, line, reason):
    path = tmp_path / "policy.yaml"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert caught.value.line == line, str(caught.value)
    assert reason in caught.value.reason
    assert str(caught.value).startswith(f"{path}:{line}: " if line else f"{path}: ")


def test_duplicate_key_id_is_refused(tmp_path):
    _, record = new_key("alice", "acme", [])
    policy = base_policy()
    policy["keys"] = [record.model_dump(mode="json")]
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": [record.model_dump(mode="json")]}))
    write_policy_file(tmp_path / "policy.yaml", policy)
    with pytest.raises(PolicyError, match="duplicate key id") as caught:
        load_policy(tmp_path / "policy.yaml")
    lines = (tmp_path / "keys.yaml").read_text().splitlines()
    # YAML quotes an id that reads as a number ('123e4'), so match the id, not the exact line.
    expected = next(n for n, line in enumerate(lines, 1) if line.strip().startswith("id:") and record.id in line)
    assert caught.value.path == str(tmp_path / "keys.yaml") and caught.value.line == expected


def test_example_policy_is_valid():
    loaded = load_policy(EXAMPLE)
    assert loaded.policy.tenants and loaded.policy.routes


def test_schema_file_matches_the_models():
    on_disk = json.loads((ROOT / "policies" / "schema.json").read_text())
    assert on_disk == policy_schema(), "regenerate: portcullis policy schema > policies/schema.json"


def test_schema_validates_the_example():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(yaml.safe_load(EXAMPLE.read_text()), policy_schema())


def test_policy_check_cli(tmp_path, capsys):
    assert main(["policy", "check", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "POST   /v1/chat/completions" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("routes: []\ntenants: {a: {}}\n")
    assert main(["policy", "check", str(bad)]) == 1
    assert f"INVALID {bad}:1: routes" in capsys.readouterr().out
    assert main(["policy", "check", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read: No such file or directory" in capsys.readouterr().out


def test_policy_check_warns_about_files_it_names_that_are_missing(tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(EXAMPLE.read_text())
    assert main(["policy", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: keys_file keys.yaml does not exist yet, so no API key works" in out
    assert "warning: jwt.jwks_file jwks.json does not exist" in out
    (tmp_path / "keys.yaml").write_text("keys: []\n")
    (tmp_path / "jwks.json").write_text('{"keys": []}')
    assert main(["policy", "check", str(path)]) == 0
    assert "does not exist" not in capsys.readouterr().out  # (its budgets on memory:// are warned about)


def test_refused_reload_logs_file_line_reason_and_keeps_serving(tmp_path):
    from structlog.testing import capture_logs

    from portcullis.gateway.policy.store import PolicyStore

    path = tmp_path / "policy.yaml"
    write_policy_file(path, base_policy())
    store = PolicyStore(path)
    path.write_text(path.read_text().replace("models:", "modles:", 1))
    with capture_logs() as logs:
        assert store.reload() is False
    (event,) = [e for e in logs if e["event"] == "policy_reload_refused"]
    assert event["error"].startswith(f"{path}:{event['line']}: ") and "did you mean 'models'?" in event["error"]
    assert store.current.policy.tenants["acme"].models == ["demo", "other"]


async def _wait(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not applied within 2 s"
        await asyncio.sleep(0.02)


async def test_hot_reload_applies_good_edits_and_refuses_bad_ones(gw, stub, caplog):
    body = {"model": "other", "prompt": "hi"}
    async with gw.client() as client:
        response, _ = await gw.call(client, "POST", "/v1/completions", json=body, headers=gw.auth())
        assert response.status_code == 200
        stub.chunk_delay_s = 0.1  # an in-flight stream must survive the reload
        in_flight = asyncio.create_task(client.post(
            "/v1/chat/completions", headers=gw.auth(),
            json={"model": "other", "messages": [{"role": "user", "content": "x"}], "stream": True,
                  "max_tokens": 10}))
        await asyncio.sleep(0.2)
        policy = base_policy()
        policy["tenants"]["acme"]["models"] = ["demo"]
        gw.write_policy(policy)
        started = time.monotonic()
        await _wait(lambda: gw.gateway.store.generation == 1)
        assert time.monotonic() - started < 2.0
        streamed = await in_flight
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        # The stream's audit line lands just after its last byte: wait for it, so the next
        # call counts only its own line.
        assert len(await gw.wait_audit(2, timeout=10)) == 2
        stub.chunk_delay_s = 0.0
        response, record = await gw.call(client, "POST", "/v1/completions", json=body, headers=gw.auth())
        assert response.status_code == 403
        (gw.policy_path).write_text("routes: [\n")  # a broken edit
        await _wait(lambda: gw.gateway.store.last_error is not None)
        assert gw.gateway.store.last_error.line is not None
        assert str(gw.policy_path) in str(gw.gateway.store.last_error)
        response, _ = await gw.call(client, "POST", "/v1/completions", json={**body, "model": "demo"},
                                    headers=gw.auth())
        assert response.status_code == 200  # the last good policy still serves
        assert gw.gateway.store.generation == 1


async def test_keys_file_edit_is_picked_up(gw):
    token, record = new_key("zed", "globex", [])
    keys_path = Path(gw.folder / "keys.yaml")
    data = yaml.safe_load(keys_path.read_text())
    data["keys"].append(record.model_dump(mode="json"))
    keys_path.write_text(yaml.safe_dump(data))
    await _wait(lambda: gw.gateway.store.generation == 1)
    async with gw.client() as client:
        response, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                    headers={"authorization": f"Bearer {token}"})
    assert response.status_code == 200



async def test_a_key_just_created_works_at_once_and_bad_keys_read_nothing(gateways, capsys, monkeypatch):
    """A key from `portcullis keys create` works on its first request, not at the next poll (up
    to 2 s of 401 before, issue 30): an unknown key makes the gateway look whether its files
    changed. A flood of unknown keys costs a look (a stat) each, never a read of the files."""
    from portcullis.gateway.policy import store as store_module

    loads = []
    monkeypatch.setattr(store_module, "load_policy", lambda path: loads.append(path) or load_policy(path))
    gw = gateways.start(reload_interval_s=2.0)  # the slowest poll the settings allow
    loads.clear()  # the load at start
    body = {"model": "demo", "prompt": "x", "max_tokens": 2}
    async with gw.client() as client:
        for i in range(20):
            response = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer ptc_{i:012x}.{'x' * 43}"})
            assert response.status_code in (401, 429)  # 429 once the failed-auth throttle bites
        assert loads == []
        assert main(["keys", "--policy", str(gw.policy_path), "create", "--principal", "zed", "--tenant", "globex"]) == 0
        token = capsys.readouterr().out.strip()
        response = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {token}"})
    assert response.status_code == 200 and len(loads) == 1


async def test_key_revoked_while_a_reload_reads_the_files_is_refused_after_the_next_poll(gw, monkeypatch):
    """A write that lands while a reload is parsing (a 3,000-key file takes seconds) must not be
    mistaken for what was loaded: the next poll sees it and the revocation applies."""
    from portcullis.gateway.auth.keys import KeyBook, split_key
    from portcullis.gateway.policy import loader

    alice_id = split_key(gw.keys["alice"])[0]
    merge, revoked = loader._merge_keys, []

    def merge_after_a_revocation(*args):
        if not revoked:  # both files are read by now: the revocation lands mid-load
            revoked.append(KeyBook(gw.folder / "keys.yaml").revoke(alice_id))
        return merge(*args)

    monkeypatch.setattr(loader, "_merge_keys", merge_after_a_revocation)
    policy = base_policy()
    policy["tenants"]["globex"]["models"] = ["demo"]
    gw.write_policy(policy)
    await _wait(lambda: gw.gateway.store.generation >= 1)
    await _wait(lambda: gw.gateway.store.current.keys[alice_id].revoked_at is not None)
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                         headers=gw.auth("alice"))
    assert response.status_code == 401 and record["reason"] == "key_revoked"


def _policy_series(store) -> dict[str, str]:
    from portcullis.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.watch_policy(store)
    lines = metrics.render().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in lines if line.startswith("portcullis_gateway_policy")}


async def test_refused_reload_shows_in_readiness_and_metrics_and_is_logged_once(gw):
    """Removing a tenant whose key is still in keys.yaml is refused: the old policy (and that key)
    keeps serving, so operators must see it in /readyz and the metrics, and in one log line."""
    from structlog.testing import capture_logs

    async with gw.client() as client:
        assert (await client.get("/readyz")).json() == {"status": "ready"}
        policy = base_policy()
        del policy["tenants"]["globex"]  # carol's key names it
        with capture_logs() as logs:
            gw.write_policy(policy)
            await _wait(lambda: gw.gateway.store.last_error is not None)
            for _ in range(3):  # touched again: seen again, refused again, not logged again
                gw.policy_path.touch()
                before = gw.gateway.store.refusals
                await _wait(lambda before=before: gw.gateway.store.refusals > before)
        refused = [e for e in logs if e["event"] == "policy_reload_refused"]
        assert len(refused) == 1 and "names tenant 'globex'" in refused[0]["error"]
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready", "policy": {"reload_refused": True, "serving_generation": 0}}
        assert "globex" not in ready.text  # the reason is for the log and the admin-only metrics
        series = _policy_series(gw.gateway.store)
        assert series["portcullis_gateway_policy_reload_refused"] == "1.0"
        assert series["portcullis_gateway_policy_reload_refusals_total"] == "4.0"
        assert series["portcullis_gateway_policy_generation"] == "0.0"
        (error,) = [k for k in series if k.startswith("portcullis_gateway_policy_reload_error_info")]
        assert 'file="' + str(gw.folder / "keys.yaml") + '"' in error and "globex" in error
        gw.write_policy(base_policy())  # the admin puts it back
        await _wait(lambda: gw.gateway.store.last_error is None)
        assert (await client.get("/readyz")).json() == {"status": "ready"}
        assert _policy_series(gw.gateway.store)["portcullis_gateway_policy_reload_refused"] == "0.0"


def test_a_3000_key_file_loads_in_well_under_a_second_and_reads_the_same_as_yaml(tmp_path):
    """Each reload re-reads every key: at 3,000 keys that took 2.4 s (and stalled requests);
    the file as `portcullis keys` writes it is now read in a fraction of that."""
    from portcullis.gateway.auth.keys import write_keys_file
    from portcullis.gateway.policy.models import KeysFile

    _, first = new_key("user", "acme", ["user"])
    records = [first.model_copy(update={"id": f"{n:012x}", "principal": f"user{n}"}) for n in range(3000)]
    write_keys_file(tmp_path / "keys.yaml", KeysFile(keys=records))
    write_policy_file(tmp_path / "policy.yaml", base_policy())
    started = time.perf_counter()
    loaded = load_policy(tmp_path / "policy.yaml")
    assert time.perf_counter() - started < 1.0
    assert list(loaded.keys.values()) == records
    # Any YAML tool reads the file the same way: it is YAML, in its JSON-compatible style.
    write_keys_file(tmp_path / "few.yaml", KeysFile(keys=records[:20]))
    assert yaml.safe_load((tmp_path / "few.yaml").read_text())["keys"] == [r.model_dump(mode="json") for r in records[:20]]


async def test_a_revocation_applies_while_an_edit_of_the_policy_file_is_refused(gw):
    """`keys revoke` promises the gateway refuses the key within 2 s: a broken edit of the policy
    file (refused, last good policy serving) must not hold revocations back until it is fixed."""
    from portcullis.gateway.auth.keys import KeyBook, split_key

    gw.policy_path.write_text("routes: [\n")
    await _wait(lambda: gw.gateway.store.last_error is not None)
    KeyBook(gw.folder / "keys.yaml").revoke(split_key(gw.keys["alice"])[0])
    await _wait(lambda: gw.gateway.store.generation == 1)
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                         headers=gw.auth("alice"))
        assert response.status_code == 401 and record["reason"] == "key_revoked"
        response, _ = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                    headers=gw.auth("bob"))
        assert response.status_code == 200  # the rest of the last good policy still serves
        assert (await client.get("/readyz")).json()["policy"]["reload_refused"] is True  # still refused
