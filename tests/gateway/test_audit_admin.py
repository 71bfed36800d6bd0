"""Admin actions in the audit log: each `portcullis keys` change, each policy reload (applied or
refused), gateway start and stop, one line each; the policy generation in request lines."""

from __future__ import annotations

import asyncio
import hashlib
import time

from portcullis.cli import main
from portcullis.gateway.audit.review import verify

from .conftest import write_policy_file


async def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _events(gw, name: str) -> list[dict]:
    return [r for r in gw.gateway_events() if r["event"] == name]


def test_each_key_action_writes_one_line_without_the_secret(gw, capsys):
    policy = str(gw.policy_path)
    assert main(["keys", "--policy", policy, "create", "--principal", "carol", "--tenant", "acme"]) == 0
    token = capsys.readouterr().out.strip()
    [created] = _events(gw, "admin_action")
    key_id = token.split("_", 1)[1].split(".", 1)[0]
    assert created["action"] == "key_created" and created["principal"] == "carol" and created["key_id"] == key_id
    assert created["actor"] and created["via"] == "portcullis keys"
    assert main(["keys", "--policy", policy, "rotate", key_id, "--overlap", "1h"]) == 0
    new_token = capsys.readouterr().out.strip()
    assert main(["keys", "--policy", policy, "revoke", key_id]) == 0
    assert main(["keys", "--policy", policy, "revoke", key_id]) == 0  # already revoked: nothing changed
    actions = _events(gw, "admin_action")
    assert [a["action"] for a in actions] == ["key_created", "key_rotated", "key_revoked"]
    assert actions[1]["replaces"] == key_id and actions[2]["key_id"] == key_id
    text = gw.audit_text()
    assert token.split(".")[1] not in text and new_token.split(".")[1] not in text
    assert verify(gw.audit_path, keyring=gw.gateway.keyring).ok


async def test_a_refused_reload_writes_one_line_and_an_applied_one_its_hash_and_generation(gw):
    store = gw.gateway.store
    gw.policy_path.write_text("version: 1\nroutes: [\n")  # not YAML
    await _until(lambda: store.refusals >= 1)
    await asyncio.sleep(0.3)  # several reload intervals: the same refused file is not audited again
    [refused] = _events(gw, "policy_reload")
    broken = hashlib.sha256(gw.policy_path.read_bytes()).hexdigest()
    assert refused["outcome"] == "refused" and refused["policy_generation"] == 0
    assert refused["policy_sha256"] == broken and "policy.yaml" in refused["error"]
    policy = dict(gw.policy, hide_unknown_models=True)
    write_policy_file(gw.policy_path, policy)
    await _until(lambda: store.generation == 1)
    applied = _events(gw, "policy_reload")[1:]
    assert len(applied) == 1 and applied[0]["outcome"] == "applied" and applied[0]["policy_generation"] == 1
    assert applied[0]["policy_sha256"] == hashlib.sha256(gw.policy_path.read_bytes()).hexdigest()
    async with gw.client() as client:
        _, record = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                  headers=gw.auth())
    assert record["policy_generation"] == 1


async def test_start_and_stop_are_audited(gateways):
    gw = gateways.start()
    [start] = _events(gw, "gateway_start")
    assert start["policy_generation"] == 0 and len(start["policy_sha256"]) == 64 and start["pid"]
    async with gw.client() as client:
        _, record = await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"},
                                  headers=gw.auth())
    assert record["policy_generation"] == 0
    gw.server.stop()
    events = [r.get("event") for r in gw.gateway_events()]
    assert events[0] == "gateway_start" and events[-2:] == ["gateway_stop", "checkpoint"]
    verdict = verify(gw.audit_path, keyring=gw.gateway.keyring)
    assert verdict.ok and verdict.checkpoints >= 1 and verdict.notes == [], verdict


async def test_a_key_change_made_without_the_policy_is_audited_by_the_reload_it_causes(gw, capsys):
    """`portcullis keys --keys-file` (or an editor, or a Secret update) writes no admin line of
    its own: the reload that applies it names the keys it added, re-dated and revoked."""
    keys_file = str(gw.policy_path.parent / gw.policy["keys_file"])
    store = gw.gateway.store
    assert main(["keys", "--keys-file", keys_file, "create", "--principal", "carol", "--tenant", "acme"]) == 0
    created = capsys.readouterr().out.strip().split("_", 1)[1].split(".", 1)[0]
    await _until(lambda: store.generation == 1)
    assert main(["keys", "--keys-file", keys_file, "rotate", created, "--overlap", "1h"]) == 0
    rotated = capsys.readouterr().out.strip().split("_", 1)[1].split(".", 1)[0]
    await _until(lambda: store.generation == 2)
    assert main(["keys", "--keys-file", keys_file, "revoke", rotated]) == 0
    await _until(lambda: store.generation == 3)
    first, second, third = _events(gw, "policy_reload")
    assert first["keys_added"] == [created] and "keys_revoked" not in first
    assert second["keys_added"] == [rotated] and second["keys_expiry_changed"] == [created]
    assert third["keys_revoked"] == [rotated] and "keys_added" not in third
    digest = hashlib.sha256((gw.policy_path.parent / gw.policy["keys_file"]).read_bytes()).hexdigest()
    assert third["keys_sha256"] == digest and not _events(gw, "admin_action")
    assert verify(gw.audit_path, keyring=gw.gateway.keyring).ok
