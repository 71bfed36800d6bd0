"""The keyed audit log: HMAC links under a keyring kept outside the log's folder, signed
checkpoints, key rotation, tampering (edit, delete, reorder, truncate, a whole rewrite with a
plain SHA-256 chain or another key), and logs from before keys existed."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from portcullis.cli import main
from portcullis.gateway.audit import log as audit_log
from portcullis.gateway.audit.keys import (
    AuditKeyring,
    KeyringError,
    check_outside,
    checkpoint_message,
)
from portcullis.gateway.audit.log import AuditLog, split_mac
from portcullis.gateway.audit.review import verify


@pytest.fixture
def keyring(tmp_path: Path) -> AuditKeyring:
    return AuditKeyring.load_or_create(tmp_path / "secrets" / "audit-keyring.json")


@pytest.fixture
def path(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    return tmp_path / "logs" / "audit.log"


def _write(path: Path, keyring: AuditKeyring | None, n: int, start: int = 0, every: int = 1000) -> None:
    log = AuditLog(path, 10**8, 5, keyring=keyring, checkpoint_lines=every)
    for i in range(start, start + n):
        log.write(request_id=f"r{i}", principal="alice", status=200, decision="allowed")
        if every < n:
            log.flush()  # one batch per line, so checkpoints fall every `every` lines
    log.close()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _save(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def _remac(record: dict, keyring: AuditKeyring) -> str:
    """`record` as a line with a valid MAC under the keyring's current key."""
    body = json.dumps({k: v for k, v in record.items() if k != "mac"}, separators=(",", ":"))[:-1].encode()
    return (body + b',"mac":"%s"}' % keyring.current_chain.mac(body).encode()).decode()


def test_a_keyed_log_verifies_with_its_keyring(path, keyring):
    _write(path, keyring, 10, every=4)
    records = [json.loads(line) for line in _lines(path)]
    assert all(r["key"] == keyring.current_chain.id and len(r["mac"]) == 64 for r in records)
    assert [r["seq"] for r in records if r.get("event") == "checkpoint"] == [5, 10, 13]  # 4 lines, 4, 2 at close
    verdict = verify(path, keyring=keyring)
    assert verdict.ok and verdict.lines == 13 and verdict.keyed == 13 and verdict.checkpoints == 3, verdict
    assert verdict.notes == [] and verdict.first_bad is None


def test_each_link_is_the_previous_lines_mac(path, keyring):
    _write(path, keyring, 3)
    lines = [line.encode() for line in _lines(path)]
    for before, after in zip(lines, lines[1:]):
        assert json.loads(after)["prev"] == split_mac(before)[1] == json.loads(before)["mac"]
    body, mac = split_mac(lines[0])
    assert keyring.current_chain.mac(body) == mac


TAMPERING = {
    "edited": (lambda lines: lines[:4] + [lines[4].replace('"status":200', '"status":201')] + lines[5:],
               "audit.log:5", "its MAC does not match"),
    "deleted": (lambda lines: lines[:4] + lines[5:], "audit.log:5", "removed"),
    "reordered": (lambda lines: lines[:4] + [lines[5], lines[4]] + lines[6:], "audit.log:5", "prev"),
    "truncated mid-line": (lambda lines: lines[:-1] + [lines[-1][:40]], "audit.log:11", "incomplete"),
}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_tampering_fails_and_names_the_first_bad_line(path, keyring, how, capsys):
    _write(path, keyring, 10)
    change, where, words = TAMPERING[how]
    lines = change(_lines(path))
    path.write_text("\n".join(lines) + ("" if how.startswith("truncated") else "\n"))
    verdict = verify(path, keyring=keyring)
    assert not verdict.ok and verdict.first_bad == where, verdict.problems
    assert words in verdict.problems[0], verdict.problems
    assert main(["audit", "--file", str(path), "--keyring", str(keyring.path), "verify"]) == 1
    assert f"first bad line {where}" in capsys.readouterr().out


def test_records_cut_from_the_end_show_against_a_checkpoint_head(path, keyring, capsys):
    _write(path, keyring, 10)
    head = verify(path, keyring=keyring).head
    _save(path, _lines(path)[:-3])  # the closing checkpoint and two records gone
    verdict = verify(path, keyring=keyring)
    assert verdict.ok and "after the last signed checkpoint" in verdict.notes[-1]  # the chain alone cannot tell
    assert main(["audit", "--file", str(path), "--keyring", str(keyring.path), "verify", "--head", head]) == 1
    assert "is not in the log" in capsys.readouterr().out


def test_a_whole_rewrite_with_a_plain_sha256_chain_fails(path, keyring):
    _write(path, keyring, 6)
    prev, forged = "0" * 64, []
    for seq, line in enumerate(_lines(path), start=1):
        record = {k: v for k, v in json.loads(line).items() if k not in ("seq", "key", "prev", "mac")}
        if record.get("event") == "checkpoint":
            continue
        record["status"] = 500
        body = json.dumps(record, separators=(",", ":"))[:-1] + f',"seq":{seq},"prev":"{prev}"}}'
        forged.append(body)
        prev = hashlib.sha256(body.encode()).hexdigest()
    _save(path, forged)
    assert verify(path).ok  # as an unkeyed log, it is a consistent chain...
    verdict = verify(path, keyring=keyring)  # ...but not one this gateway wrote
    assert not verdict.ok and verdict.first_bad == "audit.log:1", verdict.problems
    assert "without a MAC where the log is keyed" in verdict.problems[0]


def test_a_rewrite_under_another_key_fails(path, keyring, tmp_path):
    other = AuditKeyring.generate()
    _write(path, other, 4)
    verdict = verify(path, keyring=keyring)
    assert not verdict.ok and verdict.first_bad == "audit.log:1"
    assert "is not in the keyring" in verdict.problems[0]


def test_an_unkeyed_line_after_keyed_ones_fails(path, keyring):
    _write(path, keyring, 3)
    _write(path, None, 2, start=3)  # a writer without the key appends: chained, but unkeyed
    verdict = verify(path, keyring=keyring)
    assert not verdict.ok and verdict.first_bad == "audit.log:5", verdict.problems


def test_a_forged_checkpoint_signature_is_caught(path, keyring):
    _write(path, keyring, 4)
    lines = _lines(path)
    checkpoint = json.loads(lines[-1])
    assert checkpoint["event"] == "checkpoint"
    # Someone holding the MAC key but not the signing key signs with a key of their own.
    forger = AuditKeyring.generate().current_signing
    checkpoint["sig"] = forger.sign(checkpoint_message(checkpoint["head_seq"], checkpoint["head"], checkpoint["time"]))
    lines[-1] = _remac(checkpoint, keyring)
    _save(path, lines)
    verdict = verify(path, keyring=keyring)
    assert not verdict.ok and verdict.first_bad == "audit.log:5"
    assert "signature does not verify (forged)" in verdict.problems[0], verdict.problems


def test_rotation_keeps_old_lines_verifiable(path, keyring, monkeypatch, capsys):
    monkeypatch.setattr(audit_log, "KEYRING_CHECK_S", 0.0)
    log = AuditLog(path, 2048, 20, keyring=AuditKeyring.load(keyring.path))  # rotates files too
    for i in range(8):
        log.write(request_id=f"r{i}", status=200)
    log.flush()
    old_id = keyring.current_chain.id
    os.utime(keyring.path, ns=(0, 0))  # so the rewrite below shows as a change whatever the clock's grain
    assert main(["audit", "rotate-key", "--keyring", str(keyring.path)]) == 0
    for i in range(8, 16):
        log.write(request_id=f"r{i}", status=200)
    log.close()
    rotated = AuditKeyring.load(keyring.path)
    assert set(rotated.chain) == {old_id, rotated.current_chain.id} and len(rotated.signing) == 2
    records = [json.loads(line) for file in sorted(path.parent.iterdir()) for line in _lines(file)]
    assert {r["key"] for r in records} == {old_id, rotated.current_chain.id}
    verdict = verify(path, keyring=rotated)
    assert verdict.ok and verdict.keyed == verdict.lines and verdict.checkpoints >= 1, verdict
    assert not verify(path, keyring=keyring).ok  # the keyring from before lacks the new key


def test_a_log_from_before_keys_verifies_as_unkeyed_and_goes_on_keyed(path, tmp_path):
    _write(path, None, 3)  # written before this change: a plain SHA-256 chain
    verdict = verify(path)
    assert verdict.ok and verdict.keyed == 0 and "3 lines are unkeyed" in verdict.notes[0]
    keyring = AuditKeyring.load_or_create(tmp_path / "secrets" / "audit-keyring.json")
    _write(path, keyring, 3, start=3)
    records = [json.loads(line) for line in _lines(path)]
    assert "key" not in records[2] and records[3]["prev"] == hashlib.sha256(_lines(path)[2].encode()).hexdigest()
    verdict = verify(path, keyring=keyring)
    assert verdict.ok and verdict.keyed == 4 and "3 lines are unkeyed" in verdict.notes[0], verdict
    assert not verify(path).ok  # keyed lines cannot be checked without the keyring


def test_the_keyring_is_private_and_outside_the_log_folder(tmp_path, keyring, path):
    assert stat.S_IMODE(keyring.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(keyring.path.parent.stat().st_mode) == 0o700
    assert AuditKeyring.load_or_create(keyring.path).current_chain == keyring.current_chain  # not replaced
    with pytest.raises(KeyringError, match="in the audit log's folder"):
        check_outside(path.parent / "keyring.json", path)
    keyring.path.chmod(0o644)
    with pytest.raises(KeyringError, match="chmod 600"):
        AuditKeyring.load_or_create(keyring.path)


def test_prompt_fingerprints_correlate_but_are_not_plain_hashes(keyring):
    same = keyring.fingerprint(b"def add(a, b):")
    assert same == keyring.fingerprint(b"def add(a, b):") != keyring.fingerprint(b"def sub(a, b):")
    assert same != hashlib.sha256(b"def add(a, b):").hexdigest()
    assert AuditKeyring.generate().fingerprint(b"def add(a, b):") != same  # a guess needs the key
    keyring.rotate()
    assert AuditKeyring.load(keyring.path).fingerprint(b"def add(a, b):") == same  # rotation keeps it


async def test_a_gateway_creates_its_keyring_beside_the_policy_and_verify_finds_it(gw, capsys):
    keyring = gw.folder / "secrets" / "audit-keyring.json"
    assert keyring.exists() and stat.S_IMODE(keyring.stat().st_mode) == 0o600
    async with gw.client() as client:
        await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"}, headers=gw.auth())
    assert main(["audit", "--policy", str(gw.policy_path), "verify"]) == 0
    assert "OK:" in capsys.readouterr().out
