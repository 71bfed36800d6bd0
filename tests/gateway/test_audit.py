"""The audit log: chain verification (intact, edited, deleted, swapped), rotation, several
writer processes, and `portcullis audit` filtering and summaries."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import structlog.testing
from starlette.requests import Request

from portcullis.cli import main
from portcullis.gateway.app import AuditEveryResponse
from portcullis.gateway.audit.log import (
    FIELD_LIMIT,
    AuditLog,
    Backlog,
    ChainedFile,
    bounded,
    open_record,
)
from portcullis.gateway.audit.record import RequestRecord
from portcullis.gateway.audit.review import verify


def _write(path: Path, n: int, max_bytes: int = 10**8, start: int = 0, **extra) -> None:
    log = AuditLog(path, max_bytes, 5)
    for i in range(start, start + n):
        log.write(request_id=f"r{i}", principal=f"p{i % 3}", tenant="acme" if i % 2 else "globex",
                  status=200 if i % 4 else 429, decision="allowed" if i % 4 else "denied",
                  reason="ok" if i % 4 else "request_rate_limit", model="demo",
                  prompt_tokens=10, completion_tokens=5, **extra)
    log.close()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _save(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def _notes(verdict) -> list[str]:
    """The notes besides the one every unkeyed log (written without a keyring) gets."""
    return [note for note in verdict.notes if "lines are unkeyed" not in note]


def test_intact_log_verifies(tmp_path):
    path = tmp_path / "audit.log"
    _write(path, 20)
    verdict = verify(path)
    assert verdict.ok and verdict.lines == 20 and not _notes(verdict)
    assert verdict.notes == ["20 lines are unkeyed (a plain SHA-256 chain, written before audit keys): the chain "
                             "shows an edit, but not a rewrite of the whole log"]


TAMPERING = {
    "edited": lambda lines: lines[:5] + [lines[5].replace('"status":200', '"status":201')] + lines[6:],
    "deleted": lambda lines: lines[:5] + lines[6:],
    "swapped": lambda lines: lines[:5] + [lines[6], lines[5]] + lines[7:],
    "inserted": lambda lines: lines[:5] + [lines[5]] + lines[5:],
}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_tampering_is_detected(tmp_path, how, capsys):
    path = tmp_path / "audit.log"
    _write(path, 20)
    _save(path, TAMPERING[how](_lines(path)))
    verdict = verify(path)
    assert not verdict.ok and verdict.problems
    assert main(["audit", "--file", str(path), "verify"]) == 1
    assert "TAMPERED" in capsys.readouterr().out


def test_verify_says_which_line_and_what_happened(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, 20)
    lines = _lines(path)
    _save(path, TAMPERING["edited"](lines))
    assert main(["audit", "--file", str(path), "verify"]) == 1
    assert "audit.log:6: this record was edited after it was written" in capsys.readouterr().out
    _save(path, TAMPERING["deleted"](lines))
    assert main(["audit", "--file", str(path), "verify"]) == 1
    assert "audit.log:6: seq 7 follows 5: seq 6 removed or moved" in capsys.readouterr().out
    path.write_text("\n".join(lines)[:-30])  # a last line cut short
    assert main(["audit", "--file", str(path), "verify"]) == 1
    assert "audit.log:20: the last line is incomplete" in capsys.readouterr().out


def test_records_cut_from_either_end_are_caught(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, 10)
    head = verify(path).head
    lines = _lines(path)
    _save(path, lines[1:])  # nothing was ever rotated, so seq 1 must be here
    assert main(["audit", "--file", str(path), "verify"]) == 1
    assert "the chain starts at seq 2, not 1, and no rotated file holds" in capsys.readouterr().out
    _save(path, lines[:-2])
    assert main(["audit", "--file", str(path), "verify"]) == 0  # the chain alone cannot see this
    assert main(["audit", "--file", str(path), "verify", "--head", head]) == 1
    assert f"the head recorded earlier ({head}) is not in the log" in capsys.readouterr().out
    _save(path, lines)
    assert main(["audit", "--file", str(path), "verify", "--head", head]) == 0


def test_removed_rotated_files_are_caught(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, 30, max_bytes=2048)
    assert (tmp_path / "audit.log.3").exists() and not (tmp_path / "audit.log.5").exists()
    verdict = verify(path)
    assert verdict.ok and _notes(verdict) == [] and verdict.first_seq == 1
    (tmp_path / "audit.log.2").unlink()  # the middle one: .3 must still be read, and the gap seen
    verdict = verify(path)
    assert not verdict.ok and any(p.startswith("audit.log.1:1: seq") for p in verdict.problems), verdict.problems
    path.unlink()
    assert main(["audit", "--file", str(path), "verify"]) == 1
    assert "audit.log is missing (deleted?)" in capsys.readouterr().out


def test_empty_and_missing_logs(tmp_path, capsys):
    path = tmp_path / "audit.log"
    path.write_text("")
    assert main(["audit", "--file", str(path), "verify"]) == 0
    assert "no records yet" in capsys.readouterr().out
    assert main(["audit", "--file", str(tmp_path / "none.log"), "verify"]) == 1
    assert "no audit log at" in capsys.readouterr().err


def test_chain_continues_across_rotation_and_reopen(tmp_path):
    path = tmp_path / "audit.log"
    _write(path, 30, max_bytes=2048)
    _write(path, 30, max_bytes=2048, start=30)  # a restarted gateway continues the chain
    assert (tmp_path / "audit.log.1").exists()
    verdict = verify(path)
    assert verdict.ok, verdict.problems


WRITER = """
import sys
from pathlib import Path
from starlette.requests import Request

from portcullis.gateway.audit.log import AuditLog
log = AuditLog(Path(sys.argv[1]), 10**8, 3)
for i in range(50):
    log.write(request_id=f"{sys.argv[2]}{i}", status=200)
log.close()
"""


def test_several_processes_share_one_chain(tmp_path):
    # Separate interpreters (not fork): the test process has server threads running.
    path = tmp_path / "audit.log"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag]) for tag in "ab"]
    assert [proc.wait(timeout=60) for proc in procs] == [0, 0]
    verdict = verify(path)
    assert verdict.ok and verdict.lines == 100, verdict.problems


def test_audit_filter_and_summary(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, 12)
    assert main(["audit", "--file", str(path), "--tenant", "globex", "--status", "4xx", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(r["tenant"] == "globex" and r["status"] == 429 for r in rows)
    assert main(["audit", "--file", str(path), "--summary", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["by_tenant"]["acme"]["requests"] == 6
    assert summary["by_principal"]["p0"]["prompt_tokens"] == 40
    assert summary["denials_by_reason"] == {"request_rate_limit": 3}
    assert main(["audit", "--file", str(path), "--summary"]) == 0
    assert "denials by reason" in capsys.readouterr().out
    assert main(["audit", "--file", str(path), "--principal", "p1", "--since", "2000-01-01T00:00Z"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("time") and len(table) == 1 + 4


async def test_gateway_log_verifies_after_mixed_traffic(gw, capsys):
    async with gw.client() as client:
        await gw.call(client, "POST", "/v1/completions", json={"model": "demo", "prompt": "x"}, headers=gw.auth())
        await gw.call(client, "POST", "/v1/completions", json={"model": "secret-model", "prompt": "x"},
                      headers=gw.auth())
        await gw.call(client, "GET", "/nowhere")
        await gw.call(client, "POST", "/v1/completions", json={"model": "demo"}, headers={"x-api-key": "not-a-real-key-zzzz"})
    assert main(["audit", "--policy", str(gw.policy_path), "verify"]) == 0
    assert "OK: 5 records (5 keyed, 0 signed checkpoints)" in capsys.readouterr().out  # gateway_start + 4
    fields = {"time", "request_id", "principal", "key_id", "tenant", "client", "user_agent", "method", "path",
              "model", "stream", "status", "decision", "reason", "prompt_tokens", "completion_tokens",
              "cached_tokens", "ttfb_ms", "latency_ms", "seq", "prev"}
    for record in gw.audit_records():
        assert fields <= set(record)
        assert record["time"].endswith("Z")


@pytest.mark.parametrize("argv,message", [(["--status", "40x"], "not a status like 429 or a class like 4xx"),
                                          (["--decision", "deny"], "invalid choice: 'deny'"),
                                          (["--since", "yesterday"], "or a duration back from now")])
def test_audit_refuses_filters_that_could_never_match(tmp_path, capsys, argv, message):
    path = tmp_path / "audit.log"
    _write(path, 2)
    with pytest.raises(SystemExit) as exited:
        main(["audit", "--file", str(path), *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_audit_since_a_duration_and_records_without_time(tmp_path, capsys):
    path = tmp_path / "audit.log"
    _write(path, 3)
    with path.open("a") as handle:
        handle.write('{"seq": 4, "prev": "x"}\n')  # no time: never inside a range, never a crash
    assert main(["audit", "--file", str(path), "--since", "1h", "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["audit", "--file", str(path), "--until", "1h"]) == 0
    assert capsys.readouterr().out.strip() == "no matching records"


def test_audit_output_into_a_closed_pipe_ends_quietly(tmp_path):
    path = tmp_path / "audit.log"
    _write(path, 2000)
    proc = subprocess.Popen([sys.executable, "-m", "portcullis.cli", "audit", "--file", str(path), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    assert proc.wait(timeout=60) == 1
    assert b"Traceback" not in proc.stderr.read()


# ---- findings 2 and 11 of issue 13: a bounded line, a torn tail, a log moved aside --------

LINE_LIMIT = 8 * 1024


def test_every_audited_field_is_bounded(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(path, 10**8, 5)
    huge, wide = "m" * 200_000, "\U0001F600" * 50_000  # an emoji costs 12 bytes as JSON
    fields = ("model", "path", "user_agent", "client", "reason", "principal", "tenant", "route",
              "client_request_id", "key_id", "auth", "decision", "method", "request_id")
    log.write(**{name: (huge if i % 2 else wide) for i, name in enumerate(fields)}, status=200)
    log.write(request_id="r2", prompt=[{"role": "user", "content": huge}], prompt_sha256="f" * 64)
    log.close()
    lines = path.read_bytes().splitlines()
    assert max(len(line) for line in lines) < 6 * LINE_LIMIT
    assert len(lines[0]) < LINE_LIMIT
    first, second = json.loads(lines[0]), json.loads(lines[1])
    assert first["path"].startswith("mmmm") and first["path"].endswith("[cut: 200000 chars in all]")
    assert first["model"].startswith("\U0001F600") and first["model"].endswith("[cut: 50000 chars in all]")
    assert first["status"] == 200
    assert second["prompt"].startswith('[{"role": "user", "content": "mmm') and second["prompt_sha256"] == "f" * 64
    assert verify(path).ok


@pytest.mark.parametrize("char", ["a", "\x00", "\u00e9", "\U0001F600", '"'])
def test_a_value_is_cut_exactly_when_its_json_is_over_the_limit(char):
    # Short strings skip encoding (12 bytes a character at most): the edge must not move.
    for count in range(1, FIELD_LIMIT + 2):
        value = char * count
        fits = len(json.dumps(value)) <= FIELD_LIMIT
        kept = bounded(value)
        assert (kept == value) is fits
        assert len(json.dumps(kept)) <= FIELD_LIMIT


def test_a_restart_after_an_oversized_line_keeps_the_chain(tmp_path):
    path = tmp_path / "audit.log"
    _write(path, 3)
    old = AuditLog(path, 10**8, 5)
    old.file.msg(request_id="big", model="m" * 200_000)  # what an unbounded writer left behind
    old.close()
    _write(path, 2, start=3)  # the restarted gateway: must chain on, not fail
    verdict = verify(path)
    assert verdict.ok and verdict.lines == 6, verdict.problems
    assert [json.loads(line)["seq"] for line in _lines(path)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("torn", [b'{"time":"2026-12-02T01:00:00Z","request_id":"r', b"\x00" * 100])
def test_a_torn_last_line_is_closed_and_explained(tmp_path, capsys, torn):
    path = tmp_path / "audit.log"
    _write(path, 4)
    with path.open("ab") as handle:
        handle.write(torn)  # the gateway died (or the disk filled) mid-write
    _write(path, 2, start=4)
    verdict = verify(path)
    assert verdict.ok, verdict.problems
    assert any("incomplete line" in note for note in verdict.notes), verdict.notes
    assert main(["audit", "--file", str(path), "verify"]) == 0
    assert "note: audit.log:5: an incomplete line" in capsys.readouterr().out
    assert main(["audit", "--file", str(path), "--json"]) == 0  # reviewers' listing: requests only
    assert [json.loads(row)["request_id"] for row in capsys.readouterr().out.splitlines()] == [
        "r0", "r1", "r2", "r3", "r4", "r5"]


def test_a_last_line_missing_only_its_newline_is_kept(tmp_path):
    path = tmp_path / "audit.log"
    _write(path, 3)
    path.write_bytes(path.read_bytes()[:-1])
    _write(path, 1, start=3)
    verdict = verify(path)
    assert verdict.ok and verdict.lines == 4 and not _notes(verdict), (verdict.problems, verdict.notes)


def test_a_log_moved_aside_is_reported_not_restarted(tmp_path, capsys):
    path = tmp_path / "audit.log"
    log = AuditLog(path, 10**8, 5)
    for i in range(3):
        log.write(request_id=f"r{i}", status=200)
    log.flush()  # on disk before the file is moved
    path.rename(tmp_path / "elsewhere.log")
    with structlog.testing.capture_logs() as logs:
        log.write(request_id="r3", status=200)
        log.write(request_id="r4", status=200)
        log.flush()  # the writer thread logs the reset while the capture is on
    log.close()
    assert [entry["event"] for entry in logs] == ["audit_chain_reset"]
    reset = json.loads(_lines(path)[0])
    assert reset["event"] == "chain_reset" and reset["previous_seq"] == 3 and reset["seq"] == 4
    assert main(["audit", "--file", str(path), "verify"]) == 1
    out = capsys.readouterr().out
    assert "audit.log:1: the log was moved aside, truncated or replaced while the gateway wrote it" in out
    assert "not 1" not in out  # one clear explanation, not a second one about the start
    (tmp_path / "elsewhere.log").rename(tmp_path / "audit.log.1")  # the reviewer puts it back
    assert main(["audit", "--file", str(path), "verify"]) == 0
    assert "note: audit.log:1: the log was moved aside" in capsys.readouterr().out


def test_a_truncated_log_is_reported(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(path, 10**8, 5)
    for i in range(3):
        log.write(request_id=f"r{i}", status=200)
    log.flush()  # on disk before the file is truncated
    path.write_bytes(b"")
    log.write(request_id="r3", status=200)
    log.close()
    verdict = verify(path)
    assert not verdict.ok and "moved aside, truncated or replaced" in verdict.problems[0]


def test_own_and_other_writers_rotation_is_not_a_reset(tmp_path):
    path = tmp_path / "audit.log"
    one, two = AuditLog(path, 2048, 5), AuditLog(path, 2048, 5)
    for i in range(40):
        (one if i % 3 else two).write(request_id=f"r{i}", status=200)
    one.close()
    two.close()
    verdict = verify(path)
    assert verdict.ok and "chain_reset" not in path.read_text(), verdict.problems


# ---- issue 14 item 8: lines leave the event loop, in order, and none is lost -------------

def test_a_held_disk_never_holds_up_write_and_close_writes_every_line_in_order(tmp_path, monkeypatch):
    path = tmp_path / "audit.log"
    log = AuditLog(path, 4096, 50)
    disk, real_write = threading.Event(), os.write

    def held_write(fd: int, data: bytes) -> int:
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == str(tmp_path):
            disk.wait()  # the audit file's disk does not answer until the test lets it
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", held_write)
    for i in range(200):
        log.write(request_id=f"r{i}", status=200)  # returns at once: only the writer waits
    assert not log.flush(timeout=0.1)  # nothing could be written yet
    disk.set()
    log.close()  # returns once all 200 are on disk
    files = [tmp_path / f"audit.log.{i}" for i in range(50, 0, -1)] + [path]
    records = [json.loads(line) for file in files if file.exists() for line in _lines(file)]
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(200)]
    assert [r["seq"] for r in records] == list(range(1, 201)) and verify(path).ok


def _held_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The audit file's disk does not answer until the returned event is set."""
    disk, real_write = threading.Event(), os.write

    def held_write(fd: int, data: bytes) -> int:
        if not disk.is_set() and os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == str(tmp_path):
            disk.wait()
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", held_write)
    return disk


async def test_a_queue_over_its_bound_is_unwritable_at_once_and_drops_past_twice_it(tmp_path, monkeypatch):
    path = tmp_path / "audit.log"
    log = AuditLog(path, 10**8, 5, max_queued_lines=10)
    disk = _held_disk(tmp_path, monkeypatch)
    try:
        with structlog.testing.capture_logs() as logs:
            for i in range(10):
                log.write(request_id=f"r{i}", status=200)
            assert await log.writable() and log.count_refusal() == "failure"  # at the bound: still fine
            log.write(request_id="r10", status=200)
            # Over it: unwritable, answered without waiting for the disk.
            assert not await asyncio.wait_for(log.writable(), 0.5)
            assert log.count_refusal() == "backlog" and log.count_refusal() == "backlog"
            for i in range(11, 25):  # 20 fit (twice the bound); r20 to r24 are dropped
                log.write(request_id=f"r{i}", status=200)
            assert log.backlog.lines == 20
            disk.set()
            assert log.flush(timeout=10)
        assert await log.writable()
    finally:
        disk.set()
        log.close()
    events = [entry["event"] for entry in logs]
    assert events == ["audit_backlog_full", "audit_lines_dropped", "audit_backlog_drained"]
    drained = logs[-1]
    assert drained["refused_requests"] == 2 and drained["lost_records"] == 5
    records = [json.loads(line) for line in _lines(path)]
    assert [r.get("request_id") for r in records[:-1]] == [f"r{i}" for i in range(20)]
    assert records[-1]["event"] == "audit_resumed" and records[-1]["lost_records"] == 5
    assert records[-1]["error"] == "the audit queue was full" and verify(path).ok
    assert log.backlog.lines == 0 and log.backlog.bytes == 0


async def test_the_queue_is_bounded_in_bytes_too(tmp_path, monkeypatch):
    log = AuditLog(tmp_path / "audit.log", 10**8, 5, max_queued_bytes=4096)
    disk = _held_disk(tmp_path, monkeypatch)
    try:
        for i in range(3):
            log.write(request_id=f"r{i}", note="x" * 200)
        assert await log.writable()
        while log.backlog.bytes <= 4096:
            log.write(request_id="more", note="x" * 200)
        assert not await log.writable()
    finally:
        disk.set()
        log.close()


def test_a_full_backlog_serves_again_only_under_half_of_its_bound():
    backlog = Backlog(max_lines=10, max_bytes=10**6)
    assert [backlog.add(100) for _ in range(11)] == [None] * 10 + ["full"]
    assert backlog.remove(5, 500) is None and backlog.full  # 6 left: over half
    backlog.refused()
    drained = backlog.remove(1, 100)  # 5 left: half
    assert drained is not None and (drained.refused, drained.dropped) == (1, 0) and not backlog.full
    assert backlog.add(100) is None  # 6 again: under the bound, so still serving


@pytest.mark.parametrize("torn", [False, True])
def test_a_batch_cut_short_by_the_disk_costs_only_the_line_it_cut(tmp_path, monkeypatch, torn):
    """A batch goes out in one write: when the disk takes only part of it and then fails, the
    lines it took whole stay chained, the one it cut is lost (its torn bytes explained), and
    the rest are written after it."""
    path = tmp_path / "audit.log"
    chained, real_write = ChainedFile(path, 10**8, 5), os.write
    records = [open_record({"request_id": f"r{i}", "status": 200}) for i in range(3)]
    first_line = len(records[0]) + len(b',"seq":1,"prev":"' + b"0" * 64 + b'"}\n')
    calls = []

    def write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:  # the disk takes the first line (and a bit of the next), no more
            return real_write(fd, bytes(data)[: first_line + (10 if torn else 0)])
        if len(calls) == 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    errors = chained.append(records)
    chained.close()
    assert calls[0] > 2 * first_line  # all three lines went out in one write
    assert [type(e) for e in errors] == [type(None), OSError, type(None)]
    kept = [json.loads(line) for line in _lines(path) if line.startswith("{") and line.endswith("}")]
    assert [r.get("request_id", r.get("event")) for r in kept] == ["r0", *(["torn_tail"] if torn else []), "r2"]
    verdict = verify(path)
    assert verdict.ok and bool(_notes(verdict)) is torn, (verdict.problems, verdict.notes)


def test_a_line_written_after_close_is_reported_not_dropped_quietly(tmp_path):
    log = AuditLog(tmp_path / "audit.log", 10**8, 5)
    log.close()
    with structlog.testing.capture_logs() as logs:
        log.write(request_id="late", status=200)
    assert [(e["event"], e["request_id"]) for e in logs] == [("audit_write_after_close", "late")]
    assert log.flush(timeout=1)  # nothing is queued on a closed log


# ---- findings 14 and 15 of issue 13: every response audited; the gateway's own ids --------

async def _raw_http(gw, request_line: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request_line + b"\r\nHost: gw\r\nConnection: close\r\nx-request-id: mine-1\r\n\r\n")
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("request_line", [b"GET /v1/%0d%0amodels HTTP/1.1", b"POST /%0a HTTP/1.1",
                                          b"OPTIONS * HTTP/1.1", b"GET /v1/models%0A HTTP/1.1"])
async def test_requests_no_route_matches_are_answered_and_audited(gw, request_line):
    status, headers, body = await _raw_http(gw, request_line)
    assert status == 404 and json.loads(body) == {"error": {"message": "Not found.", "type": "not_found_error",
                                                            "param": None, "code": "route_not_allowed"}}
    records = await gw.wait_audit(1)
    assert len(records) == 1 and records[0]["status"] == 404 and records[0]["decision"] == "denied"
    assert records[0]["request_id"] == headers["x-request-id"] and records[0]["client_request_id"] == "mine-1"
    assert records[0]["path"] == request_line.split()[1].decode()


async def test_probes_stay_unaudited(gw):
    async with gw.client() as client:
        assert (await client.get("/healthz")).status_code == 200
    assert gw.audit_records() == []


async def test_the_gateway_makes_its_own_request_ids(gw, stub):
    async with gw.client() as client:
        body = {"model": "demo", "prompt": "x", "max_tokens": 2}
        first, one = await gw.call(client, "POST", "/v1/completions", json=body,
                                   headers={**gw.auth(), "x-request-id": "trace-1"})
        second, two = await gw.call(client, "POST", "/v1/completions", json=body,  # another tenant
                                    headers={**gw.auth("carol"), "x-request-id": "trace-1"})
        third, three = await gw.call(client, "POST", "/v1/completions", json=body,
                                     headers={**gw.auth(), "x-client-request-id": "trace-3"})
        hostile, four = await gw.call(client, "POST", "/v1/completions", json=body,
                                      headers={**gw.auth(), "x-request-id": 'a b"c'})
    assert [r.status_code for r in (first, second, third, hostile)] == [200, 200, 200, 200]
    ids = [r["request_id"] for r in (one, two, three, four)]
    assert len(set(ids)) == 4 and "trace-1" not in ids
    assert [r["client_request_id"] for r in (one, two, three, four)] == ["trace-1", "trace-1", "trace-3", None]
    assert [r.headers.get("x-client-request-id") for r in (first, second, third, hostile)] == [
        "trace-1", "trace-1", "trace-3", None]
    engine_ids = [seen["headers"]["x-request-id"] for seen in stub.requests]
    assert engine_ids == ids  # the engine gets our id, so one tenant cannot block another's


async def test_a_request_audited_without_an_answer_gets_nothing_more(gw):
    """A client that hung up before the response head is audited 499 and sent nothing: the
    outer layer must not add an answer of its own (nor a second audit line)."""
    async def hung_up(scope, receive, send):
        record = RequestRecord.start(Request(scope), gw.gateway)
        record.finish(499, "allowed", "client_disconnected")

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "headers": [], "query_string": b"", "client": ("127.0.0.1", 1), "server": ("gw", 80)}
    await AuditEveryResponse(hung_up, gw.gateway)(scope, None, send)
    assert sent == [] and [r["status"] for r in gw.audit_records()] == [499]


async def test_an_error_escaping_the_app_is_answered_and_audited(gw):
    async def broken(scope, receive, send):
        raise RuntimeError("a bug")

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "raw_path": b"/v1/models",
             "headers": [(b"x-request-id", b"mine-2")], "query_string": b"", "client": ("127.0.0.1", 1),
             "server": ("gw", 80)}
    with structlog.testing.capture_logs() as logs:
        await AuditEveryResponse(broken, gw.gateway)(scope, None, send)
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 500 and headers[b"x-client-request-id"] == b"mine-2"
    [logged] = [e for e in logs if e["event"] == "gateway_unhandled_error"]
    assert logged["request_id"] == headers[b"x-request-id"].decode()  # the log line and the answer agree
    assert json.loads(sent[1]["body"])["error"] == {"message": "Internal gateway error.", "type": "internal_server_error",
                                                    "param": None, "code": "internal_error"}
    [record] = gw.audit_records()
    assert record["status"] == 500 and record["decision"] == "failed" and record["request_id"] == headers[b"x-request-id"].decode()
