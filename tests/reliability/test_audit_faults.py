"""Faults in the audit log's storage (issue 13, finding 2): a full disk or a failing write.

The gateway fails closed: while audit lines cannot be written, requests are refused with 503
(OpenAI error body) before they reach the engine, and it serves again, with a notice in the
chain saying how many lines were lost, once the disk has room. `audit.on_failure: serve`
keeps serving instead. The disk is simulated by patching `os.write` and `os.statvfs` for the
audit file only: no real filesystem is filled.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
from collections.abc import Callable

import pytest

from gateway.audit.log import PROBE_INTERVAL_S, AuditLog
from gateway.audit.review import verify

COMPLETION = {"model": "demo", "prompt": "hello", "max_tokens": 4}


class Disk:
    """Makes the audit file's disk fail on demand; everything else writes as usual."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, audit_dir: os.PathLike) -> None:
        self.full = self.failing = False
        self.audit_dir = os.fspath(audit_dir)
        self._write: Callable[[int, bytes], int] = os.write
        self._statvfs = os.statvfs
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "statvfs", self.statvfs)

    def _is_audit(self, fd: int) -> bool:
        return os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == self.audit_dir

    def write(self, fd: int, data: bytes) -> int:
        if (self.full or self.failing) and self._is_audit(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._write(fd, data)

    def statvfs(self, path: os.PathLike) -> os.statvfs_result:
        real = self._statvfs(path)
        if self.full and os.fspath(path) == self.audit_dir:
            return os.statvfs_result((*real[:4], 0, *real[5:]))  # f_bavail = 0
        return real



async def _probe_interval() -> None:
    await asyncio.sleep(PROBE_INTERVAL_S + 0.1)


def _assert_audit_refusal(response) -> None:
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "audit_unavailable" and error["type"] == "service_unavailable"
    assert "audit log" in error["message"] and response.headers["retry-after"]


async def test_a_full_disk_refuses_requests_before_the_engine_and_recovers(gw, stub, monkeypatch):
    async with gw.client() as client:
        assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 200
        await gw.wait_audit(1)
        disk = Disk(monkeypatch, gw.folder)
        disk.full = True
        await _probe_interval()  # the free-space check runs at most once per interval
        served = len(stub.requests)
        for headers in (gw.auth(), {}):  # authenticated or not: 503, never a 500
            _assert_audit_refusal(await client.post("/v1/completions", json=COMPLETION, headers=headers))
        assert len(stub.requests) == served, "a request reached the engine while it could not be audited"
        gw.gateway.audit.flush()  # the writer has tried (and failed) their lines before the disk recovers
        disk.full = False
        await _probe_interval()
        ok = await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())
        assert ok.status_code == 200
    lines = await gw.wait_audit(3)
    resumed = next(line for line in lines if line.get("event") == "audit_resumed")
    assert resumed["lost_records"] == 2 and resumed["error"]
    assert lines[-1]["request_id"] == ok.headers["x-request-id"] and lines[-1]["status"] == 200
    assert verify(gw.audit_path).ok


async def test_a_failed_write_stops_serving_until_a_probe_succeeds(gw, stub, monkeypatch):
    disk = Disk(monkeypatch, gw.folder)
    async with gw.client() as client:
        disk.failing = True  # the disk has room by statvfs, but writes fail (EIO, quota...)
        first = await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())
        assert first.status_code == 200  # admitted before anything failed: its line is lost
        await asyncio.sleep(0.2)  # its line is queued as its response ends
        gw.gateway.audit.flush()  # and the writer has tried it, and failed
        served = len(stub.requests)
        _assert_audit_refusal(await client.post("/v1/completions", json=COMPLETION, headers=gw.auth()))
        assert len(stub.requests) == served
        await _probe_interval()
        _assert_audit_refusal(await client.post("/v1/completions", json=COMPLETION, headers=gw.auth()))
        gw.gateway.audit.flush()  # its line fails before the disk recovers
        disk.failing = False
        await _probe_interval()
        assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 200
    lines = await gw.wait_audit(2)
    assert lines[0]["event"] == "audit_resumed" and lines[0]["lost_records"] == 3
    assert lines[1]["status"] == 200
    verdict = verify(gw.audit_path)  # lost lines are no tampering, but reviewers are told
    assert verdict.ok and "No space left on device); 3 request lines were lost" in verdict.notes[0]


async def test_on_failure_serve_keeps_serving_and_counts_what_was_lost(gateways, monkeypatch):
    from tests.gateway.conftest import base_policy

    policy = base_policy()
    policy["audit"]["on_failure"] = "serve"
    gw = gateways.start(policy)
    disk = Disk(monkeypatch, gw.folder)
    async with gw.client() as client:
        disk.full = True
        await _probe_interval()
        for _ in range(2):
            assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 200
        await asyncio.sleep(0.2)  # their lines are queued as their responses end
        gw.gateway.audit.flush()  # and fail before the disk recovers
        disk.full = False
        await _probe_interval()
        assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 200
    lines = await gw.wait_audit(2)
    assert lines[0]["event"] == "audit_resumed" and lines[0]["lost_records"] == 2


async def test_a_huge_model_name_and_a_torn_line_never_switch_auditing_off(gateways):
    from tests.gateway.conftest import base_policy

    policy = base_policy()
    policy["defaults"]["max_body_bytes"] = 1024 * 1024
    gw = gateways.start(policy)
    async with gw.client() as client:
        response, record = await gw.call(client, "POST", "/v1/completions", headers=gw.auth(),
                                         json={"model": "m" * 200_000, "prompt": "x"})
        assert response.status_code in (403, 404) and record["model"].startswith("mmmm")
        assert max(len(line) for line in gw.audit_path.read_bytes().splitlines()) < 8 * 1024
        with gw.audit_path.open("ab") as handle:
            handle.write(b'{"time":"2026-12-02T01:00:00Z","req')  # a crash mid-write
        old = gw.gateway.audit  # a restarted gateway opens the log afresh
        gw.gateway.audit = AuditLog(old.path, old.file.max_bytes, old.file.backups)
        old.close()
        for headers in ({}, gw.auth()):
            response = await client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert response.status_code in (200, 401)
    await asyncio.sleep(0.2)  # the forwarded request's line is queued as its response ends
    gw.gateway.audit.flush()
    raw = gw.audit_path.read_bytes().splitlines()
    assert raw[1].startswith(b'{"time":"2026-12-02T01:00:00Z","req') and len(raw) == 5
    assert [json.loads(line).get("event") for line in raw[2:]] == ["torn_tail", None, None]
    verdict = verify(gw.audit_path)
    assert verdict.ok and "incomplete line" in verdict.notes[0], verdict.problems


async def test_a_reused_client_request_id_never_collides_at_the_engine(gw_engine):
    """Finding 15: the engine refused a second request with an id in use (400); another tenant
    could block one's requests by reusing its x-request-id. The gateway's own ids cannot collide."""
    gw = gw_engine
    streamed = {"model": "demo", "prompt": "one", "max_tokens": 64, "ignore_eos": True, "stream": True}
    async with gw.client() as first_client, gw.client() as second_client:
        async with first_client.stream("POST", "/v1/completions", json=streamed,
                                       headers={**gw.auth(), "x-request-id": "dup-1"}) as first:
            assert first.status_code == 200
            chunks = first.aiter_lines()
            assert (await anext(chunks)).startswith("data: {")  # the first is in the engine now
            second = await second_client.post(
                "/v1/completions", json={"model": "demo", "prompt": "two", "max_tokens": 2},
                headers={**gw.auth("carol"), "x-request-id": "dup-1"})
            assert second.status_code == 200, second.text
            async for _ in chunks:
                pass
    lines = await gw.wait_audit(2)
    assert [line["client_request_id"] for line in lines] == ["dup-1", "dup-1"]
    assert len({line["request_id"] for line in lines}) == 2
    assert {first.headers["x-request-id"], second.headers["x-request-id"]} == {line["request_id"] for line in lines}


async def test_readiness_says_unready_while_the_audit_log_cannot_be_written(gw, monkeypatch):
    """A load balancer should send traffic elsewhere while this replica refuses everything."""
    async with gw.client() as client:
        assert (await client.get("/readyz")).status_code == 200
        disk = Disk(monkeypatch, gw.folder)
        disk.full = True
        await _probe_interval()
        response = await client.get("/readyz")
        assert response.status_code == 503 and response.json()["status"] == "audit log unavailable"
        disk.full = False
        await _probe_interval()
        assert (await client.get("/readyz")).status_code == 200
