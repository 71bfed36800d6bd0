"""Faults in the audit log's storage (issue 13, finding 2): a full disk, a failing write, or a
disk slower than the requests.

The gateway fails closed: while audit lines cannot be written, or more of them wait for the
disk than the log's queue holds, requests are refused with 503 (OpenAI error body) before they
reach the engine, and it serves again, with a notice in the chain saying how many lines were
lost, once the disk has room (or has caught up). `audit.on_failure: serve` keeps serving
instead. The disk is simulated by patching `os.write` and `os.statvfs` for the audit file only:
no real filesystem is filled.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from portcullis.gateway.audit.log import PROBE_INTERVAL_S, AuditLog
from portcullis.gateway.audit.review import verify

COMPLETION = {"model": "demo", "prompt": "hello", "max_tokens": 4}


class Disk:
    """Makes the audit file's disk fail, or stop answering, on demand; everything else writes
    as usual. A held disk must be released before the gateway stops (its writer waits on it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, audit_dir: os.PathLike) -> None:
        self.full = self.failing = False
        self.audit_dir = os.fspath(audit_dir)
        self._answering = threading.Event()
        self._answering.set()
        self._write: Callable[[int, bytes], int] = os.write
        self._statvfs = os.statvfs
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "statvfs", self.statvfs)

    def hold(self) -> None:
        """The slowest disk: audit writes wait until `release`."""
        self._answering.clear()

    def release(self) -> None:
        self._answering.set()

    def _is_audit(self, fd: int) -> bool:
        return os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == self.audit_dir

    def write(self, fd: int, data: bytes) -> int:
        if (self.full or self.failing) and self._is_audit(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if not self._answering.is_set() and self._is_audit(fd):
            self._answering.wait()
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
    assert verify(gw.audit_path, keyring=gw.gateway.keyring).ok


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
    verdict = verify(gw.audit_path, keyring=gw.gateway.keyring)  # lost lines are no tampering, but reviewers are told
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
        gw.gateway.audit = AuditLog(old.path, old.file.max_bytes, old.file.backups, keyring=old.file.keyring)
        old.close()
        for headers in ({}, gw.auth()):
            response = await client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert response.status_code in (200, 401)
    await asyncio.sleep(0.2)  # the forwarded request's line is queued as its response ends
    gw.gateway.audit.flush()
    raw = gw.audit_path.read_bytes().splitlines()
    torn = next(i for i, line in enumerate(raw) if line.startswith(b'{"time":"2026-12-02T01:00:00Z","req'))
    # Before it: the gateway's start line and the refusal; after it, the torn tail closed and
    # chained, the old writer's closing checkpoint, and both new requests.
    assert torn == len(raw) - 5 and json.loads(raw[torn - 1])["status"] in (403, 404)
    assert [json.loads(line).get("event") for line in raw[torn + 1 :]] == ["torn_tail", "checkpoint", None, None]
    verdict = verify(gw.audit_path, keyring=gw.gateway.keyring)
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


# ---- a disk slower than the requests: the queue is bounded -----------------------------------

QUEUE_BOUND = 20


@contextmanager
def held_disk(gw, monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    """The gateway's audit log reopened with a queue of QUEUE_BOUND lines (10,000 by default) on
    a disk that holds every write until released (always released on the way out)."""
    old = gw.gateway.audit
    gw.gateway.audit = AuditLog(old.path, old.file.max_bytes, old.file.backups, max_queued_lines=QUEUE_BOUND,
                                keyring=old.file.keyring)
    old.close()
    disk = Disk(monkeypatch, gw.folder)
    disk.hold()
    try:
        yield disk
    finally:
        disk.release()


async def _serve_until_refused(gw, client) -> int:
    """Requests until the first 503; how many were served before it."""
    for served in range(QUEUE_BOUND + 5):
        response = await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())
        if response.status_code != 200:
            _assert_audit_refusal(response)
            return served
    raise AssertionError("the queue filled up but requests were still served")


def _backlog_refusals(gw) -> float:
    return gw.gateway.metrics.registry.get_sample_value("portcullis_gateway_audit_refusals_total",
                                                        {"cause": "backlog"}) or 0


async def test_a_disk_slower_than_the_requests_fills_the_queue_then_refuses_until_it_drains(gw, stub, monkeypatch):
    with held_disk(gw, monkeypatch) as disk:
        async with gw.client() as client:
            served = await _serve_until_refused(gw, client)
            assert QUEUE_BOUND <= served <= QUEUE_BOUND + 1  # a line lands just after its answer
            reached = len(stub.requests)
            started = time.monotonic()
            for _ in range(4):
                _assert_audit_refusal(await client.post("/v1/completions", json=COMPLETION, headers=gw.auth()))
            assert (await client.get("/readyz")).status_code == 503
            assert (await client.get("/healthz")).status_code == 200
            assert time.monotonic() - started < 5  # answered while the disk still holds every line
            assert len(stub.requests) == reached, "a request reached the engine while its line could not be queued"
            assert _backlog_refusals(gw) == 5
            disk.release()
            assert gw.gateway.audit.flush(timeout=10)
            assert (await client.get("/readyz")).status_code == 200
            ok = await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())
            assert ok.status_code == 200
    lines = await gw.wait_audit(served + 6)
    assert [line["status"] for line in lines] == [200] * served + [503] * 5 + [200]
    assert {line["reason"] for line in lines if line["status"] == 503} == {"audit_unavailable"}
    assert not any(line.get("event") for line in lines)  # every line written: nothing to explain
    assert verify(gw.audit_path, keyring=gw.gateway.keyring).ok


async def test_refusals_past_twice_the_bound_are_counted_lost_and_memory_stays_bounded(gw, stub, monkeypatch):
    with held_disk(gw, monkeypatch) as disk:
        async with gw.client() as client:
            served = await _serve_until_refused(gw, client)
            for _ in range(2 * QUEUE_BOUND):  # a flood while the disk is stuck
                _assert_audit_refusal(await client.post("/v1/completions", json=COMPLETION, headers=gw.auth()))
            assert gw.gateway.audit.backlog.lines == 2 * QUEUE_BOUND  # no more held, however many come
            disk.release()
            assert gw.gateway.audit.flush(timeout=10)
            assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 200
    requests = served + 1 + 2 * QUEUE_BOUND + 1
    lines = await gw.wait_audit(2 * QUEUE_BOUND + 2)
    resumed = [line for line in lines if line.get("event") == "audit_resumed"]
    audited = [line for line in lines if "request_id" in line]
    assert len(resumed) == 1 and resumed[0]["error"] == "the audit queue was full"
    assert len(audited) + resumed[0]["lost_records"] == requests  # each request audited or counted lost
    assert audited[-1]["status"] == 200 and verify(gw.audit_path, keyring=gw.gateway.keyring).ok


async def test_on_failure_serve_keeps_serving_past_the_bound_and_counts_what_it_dropped(gateways, monkeypatch):
    from tests.gateway.conftest import base_policy

    policy = base_policy()
    policy["audit"]["on_failure"] = "serve"
    gw = gateways.start(policy)
    with held_disk(gw, monkeypatch) as disk:
        async with gw.client() as client:
            for _ in range(2 * QUEUE_BOUND + 5):
                assert (await client.post("/v1/completions", json=COMPLETION, headers=gw.auth())).status_code == 200
            await asyncio.sleep(0.2)  # the last lines are queued as their responses end
            assert gw.gateway.audit.backlog.lines == 2 * QUEUE_BOUND
            disk.release()
            assert gw.gateway.audit.flush(timeout=10)
    lines = await gw.wait_audit(2 * QUEUE_BOUND + 1)
    assert lines[-1]["event"] == "audit_resumed" and lines[-1]["lost_records"] == 5
    assert verify(gw.audit_path, keyring=gw.gateway.keyring).ok
