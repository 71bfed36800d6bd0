"""Findings 7 and 8 of issue 29: record text a client chose cannot forge rows or move the
reviewer's cursor in `portcullis audit`'s human output, and `audit verify` tells records cut from
the head of the oldest file apart from rotation whenever it knows `audit.backups`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portcullis.cli import main
from portcullis.gateway.audit.log import AuditLog, ChainedFile

from .conftest import write_policy_file

# A model name (or JWT subject) that, printed raw, adds a forged row and then erases and climbs
# back over it; the rest are the other characters a terminal acts on or reorders.
HOSTILE = ("x\n2026-01-01T00:00:00Z  forged  POST  /v1/completions  200 allowed ok\u001b[2K\u001b[1A"
           "\r\t\x7f\x85\u2028\u2029\u202e")
RAW = ("\n", "\x1b", "\r", "\t", "\x7f", "\x85", "\u2028", "\u2029", "\u202e")
SHOWN = ("\\n2026-01-01T00:00:00Z", "\\x1b[2K", "\\r", "\\x85", "\\u2028", "\\u202e")
REASON = HOSTILE + "\ud800"  # a lone surrogate (JSON allows its escape) that UTF-8 cannot print


def _write(path: Path, backups: int = 5, max_bytes: int = 10**8, n: int = 2, hostile: bool = True) -> None:
    log = AuditLog(path, max_bytes, backups)
    for i in range(n):
        log.write(request_id=f"r{i}", principal=f"p{i}", tenant="acme", method="POST", path="/v1/completions",
                  model="demo", status=200, decision="allowed", reason="ok", prompt_tokens=10, completion_tokens=5)
    if hostile:
        log.write(request_id="evil", principal=HOSTILE, tenant="acme", method="POST", path="/v1/completions",
                  model=HOSTILE, status=403, decision="denied", reason=REASON, prompt_tokens=1, completion_tokens=0)
    log.close()


def _assert_tame(out: str, lines: int) -> None:
    """Exactly `lines` lines, none of the record's raw control characters, its text escaped."""
    assert len(out.splitlines()) == lines == out.count("\n"), out
    assert not [ch for ch in RAW[1:] if ch in out], out
    for text in SHOWN:
        assert text in out


@pytest.mark.parametrize("argv,lines", [([], 1 + 3), (["--model", HOSTILE], 1 + 1), (["--decision", "denied"], 1 + 1)])
def test_a_hostile_record_is_one_row_of_the_audit_table(tmp_path, capsys, argv, lines):
    path = tmp_path / "audit.log"
    _write(path)
    assert main(["audit", "--file", str(path), *argv]) == 0
    out = capsys.readouterr().out
    _assert_tame(out, lines)
    assert "\\ud800" in out


def test_the_summary_tables_escape_names_and_reasons(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path)
    assert main(["audit", "--file", str(path), "--summary"]) == 0
    # by principal: title, header, 3 rows; by tenant: 3; denials: 3; by status: 4; 3 blank lines between
    _assert_tame(capsys.readouterr().out, 5 + 3 + 3 + 4 + 3)


def test_the_usage_table_escapes_models_and_principals(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path)
    assert main(["audit", "--file", str(path), "usage"]) == 0
    _assert_tame(capsys.readouterr().out, 1 + 1 + 3)  # "usage from ...", the header, three rows


def test_json_output_keeps_the_exact_text(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path)
    assert main(["audit", "--file", str(path), "--json", "--decision", "denied"]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["model"] == HOSTILE and record["principal"] == HOSTILE
    assert main(["audit", "--file", str(path), "usage", "--json"]) == 0
    assert HOSTILE in {row["model"] for row in json.loads(capsys.readouterr().out)["rows"]}


def test_verify_text_escapes_what_a_notice_carries(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, hostile=False)
    writer = ChainedFile(path, 10**8, 5)  # someone with the volume writes a well-chained notice
    writer.msg(event="audit_resumed", failed_since="2026-01-01T00:00:00Z", error=HOSTILE, lost_records=0)
    writer.close()
    assert main(["audit", "--file", str(path), "verify"]) == 0
    out = capsys.readouterr().out
    _assert_tame(out, 3)  # the unkeyed note, the audit_resumed note, OK
    assert out.splitlines()[-1].startswith("OK: 3 records")


def test_keys_list_escapes_notes(tmp_path, capsys):
    keys = str(tmp_path / "keys.yaml")
    assert main(["keys", "--keys-file", keys, "create", "--principal", "alice", "--tenant", "acme",
                 "--note", HOSTILE]) == 0
    capsys.readouterr()
    assert main(["keys", "--keys-file", keys, "list"]) == 0
    _assert_tame(capsys.readouterr().out, 2)


# ---- finding 8: records cut from the head of the oldest rotated file ----------------------------

def _policy(folder: Path, backups: int) -> Path:
    path = folder / "policy.yaml"
    write_policy_file(path, {"version": 1, "routes": [{"method": "POST", "path": "/v1/completions"}],
                             "tenants": {"acme": {"models": ["*"]}},
                             "audit": {"path": "audit.log", "backups": backups}})
    return path


def _cut_head(path: Path, count: int) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[count:]))


def test_a_cut_head_with_room_for_more_backups_is_tampering(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, backups=1000, max_bytes=2048, n=24, hostile=False)  # six lines a file
    assert (tmp_path / "audit.log.3").exists() and not (tmp_path / "audit.log.4").exists()
    _cut_head(tmp_path / "audit.log.3", 3)
    for argv in (["--policy", str(_policy(tmp_path, 1000)), "verify"],
                 ["--file", str(path), "verify", "--backups", "1000"]):
        assert main(["audit", *argv]) == 1, argv
        out = capsys.readouterr().out
        assert ("TAMPERED audit.log.3:1: the chain starts at seq 4, not 1, yet only 3 rotated files are here "
                "of the 1000 audit.backups keeps, so none was rotated out: the records before it (seq 1-3) "
                "were removed") in out, out
        assert "FAILED" in out and "first bad line audit.log.3:1" in out
    assert main(["audit", "--policy", str(_policy(tmp_path, 1000)), "verify", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["first_bad"] == "audit.log.3:1"


def test_a_cut_head_is_a_note_when_backups_are_full_or_unknown(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, backups=2, max_bytes=2048, n=30, hostile=False)  # rotation has dropped older files
    assert (tmp_path / "audit.log.2").exists() and not (tmp_path / "audit.log.3").exists()
    assert main(["audit", "--policy", str(_policy(tmp_path, 2)), "verify"]) == 0
    out = capsys.readouterr().out
    assert "not 1: older records were in files rotated out since (audit.backups keeps 2)" in out, out
    assert main(["audit", "--file", str(path), "verify"]) == 0  # no policy: cannot tell, as before
    out = capsys.readouterr().out
    assert "not 1: older records were in files rotated out since, or were removed" in out, out
    assert "give --policy or --backups to tell them apart" in out, out
    assert main(["audit", "--policy", str(_policy(tmp_path, 3)), "verify"]) == 1  # audit.backups raised since
    assert "only 2 rotated files are here of the 3 audit.backups keeps" in capsys.readouterr().out


def test_empty_files_do_not_stand_in_for_rotated_ones(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, backups=5, max_bytes=2048, n=24, hostile=False)
    _cut_head(tmp_path / "audit.log.3", 3)
    for index in (4, 5):  # rotation never leaves an empty file: these pad the count
        (tmp_path / f"audit.log.{index}").write_text("")
    assert main(["audit", "--policy", str(_policy(tmp_path, 5)), "verify"]) == 1
    assert "only 3 rotated files are here of the 5 audit.backups keeps" in capsys.readouterr().out


def test_records_are_filtered_by_route(tmp_path, capsys):
    path = tmp_path / "audit.log"
    log = AuditLog(path, 10**8, 5)
    for route in ("/v1/completions", "/v1/embeddings", "/v1/completions"):
        log.write(request_id=route, principal="p", tenant="acme", method="POST", route=route, model="demo",
                  status=200, decision="allowed", reason="ok")
    log.close()
    assert main(["audit", "--file", str(path), "--route", "/v1/embeddings", "--json"]) == 0
    found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["route"] for r in found] == ["/v1/embeddings"]
