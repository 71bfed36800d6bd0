"""Slow and oversized clients against a real `portcullis gateway` process (the stub engine
behind it), over raw sockets: a slow head, a slow body and a huge head are cut off within
their limits without the gateway holding what they sent, and a client that reads a stream
at a byte a second is disconnected with its concurrency slot given back.

The gateway runs with one-second limits so each test takes a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from portcullis.gateway.auth.keys import new_key, write_keys_file
from portcullis.gateway.policy.models import KeysFile
from tests.gateway.conftest import ENGINE_TOKEN, GATEWAY_EVENTS, base_policy, whole_records

from .conftest import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 1.0  # --timeout-header, --timeout-body, --timeout-send and --timeout-keep-alive
SLACK_S = 2.0  # scheduling on a busy two-core machine
MAX_HEAD = 16 * 1024
CONCURRENCY = 40


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    port: int
    key: str
    log: Path
    folder: Path

    def audit(self) -> list[dict]:
        path = self.folder / "audit.log"
        records = whole_records(path.read_text()) if path.exists() else []
        return [r for r in records if r.get("event") not in GATEWAY_EVENTS]  # request lines only

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket()
        if rcvbuf:  # before connect, so the advertised window stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", self.port))
        return sock

    def completion(self, **extra: object) -> httpx.Response:
        body = {"model": "demo", "prompt": "hi", "max_tokens": 4, **extra}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=10,
                          headers={"authorization": f"Bearer {self.key}"})


@pytest.fixture(scope="module")
def slow_gw(stub: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("slow")
    token, record = new_key("alice", "acme", [])
    write_keys_file(folder / "keys.yaml", KeysFile(keys=[record]))
    (folder / "jwks.json").write_text(json.dumps({"keys": []}))
    policy = base_policy()
    policy["defaults"]["max_tokens"] = 1_000_000
    policy["tenants"]["acme"]["key_limits"] = {"concurrent_requests": 1}
    (folder / "policy.yaml").write_text(yaml.safe_dump(policy))
    (folder / "token").write_text(ENGINE_TOKEN)
    port, log = free_port(), folder / "gateway.log"
    argv = [sys.executable, "-m", "portcullis.cli", "gateway", "--port", str(port), "--policy", str(folder / "policy.yaml"),
            "--engine-url", f"unix://{stub.socket}", "--engine-token-file", str(folder / "token"),
            "--timeout-header", str(LIMIT_S), "--timeout-body", str(LIMIT_S), "--timeout-send", str(LIMIT_S),
            "--timeout-keep-alive", str(LIMIT_S), "--forwarded-allow-ips", "127.0.0.1",
            "--h11-max-incomplete-event-size", str(MAX_HEAD), "--limit-concurrency", str(CONCURRENCY)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    running = GatewayProcess(proc, port, token, log, folder)
    try:
        wait_for(lambda: _up(running), 30, "the gateway to start", every=0.1)
        yield running
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _up(gw: GatewayProcess) -> bool:
    assert gw.proc.poll() is None, gw.log.read_text()[-3000:]
    try:
        return httpx.get(f"{gw.url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes (or resets) the connection, and when."""
    began, data = time.monotonic(), b""
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - began


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a content-length, leaving the connection open."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def error_of(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), head
    return json.loads(body)["error"]


def assert_audited(gw: GatewayProcess, status: int, reason: str, count: int = 1) -> None:
    """Refusals made by the connection, before any route runs, are audited like the rest."""
    def found() -> int:
        return sum(1 for r in gw.audit() if (r.get("status"), r.get("reason")) == (status, reason))
    wait_for(lambda: found() >= count, 5, f"an audit line with {status} {reason}")


def test_a_head_sent_a_byte_at_a_time_is_cut_off(slow_gw):
    sock = slow_gw.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n")
    began, answer = time.monotonic(), b""
    sock.settimeout(0.25)
    with pytest.raises((ConnectionError, BrokenPipeError)):  # noqa: PT012 - the loop is the slowloris
        while time.monotonic() - began < LIMIT_S + SLACK_S:
            sock.send(b"x")  # one header byte every 0.25 s: never a whole head
            try:
                if chunk := sock.recv(4096):
                    answer += chunk
                else:
                    raise ConnectionError("closed")
            except TimeoutError:
                pass
    assert time.monotonic() - began < LIMIT_S + SLACK_S
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert error_of(answer)["code"] == "head_timeout"
    assert_audited(slow_gw, 408, "head_timeout")


def test_idle_and_slow_connections_are_all_closed(slow_gw):
    idle = [slow_gw.connect() for _ in range(20)]
    slow = [slow_gw.connect() for _ in range(10)]
    for sock in slow:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
    for sock in idle + slow:
        _, waited = read_until_closed(sock, LIMIT_S + SLACK_S)
        assert waited < LIMIT_S + SLACK_S
        sock.close()
    assert slow_gw.completion().status_code == 200


def test_a_body_sent_slowly_is_cut_off(slow_gw):
    sock = slow_gw.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + slow_gw.key.encode() + b"\r\ncontent-length: 1000\r\n\r\n{")
    began = time.monotonic()
    sock.settimeout(0.25)
    answer = b""
    while time.monotonic() - began < LIMIT_S + SLACK_S:
        try:
            sock.send(b" ")
            if not (chunk := sock.recv(4096)):
                break
            answer += chunk
        except TimeoutError:
            continue
        except (ConnectionError, BrokenPipeError):
            break
    assert time.monotonic() - began < LIMIT_S + SLACK_S, "the slow body was still being read"
    if answer:  # the answer may be lost to the reset of a connection closed with unread bytes
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert error_of(answer)["code"] == "body_timeout"
    assert_audited(slow_gw, 408, "body_timeout")  # what the client was told, not a hang-up (499)
    assert slow_gw.completion().status_code == 200  # the key's one slot was given back


def test_a_connection_answered_before_its_body_ended_still_idles_out(slow_gw):
    """Refused before its body is read (a bad key), the client sends the rest, then waits:
    uvicorn forgets the keep-alive timer here, which would let such connections pile up."""
    sock = slow_gw.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer nope\r\n"
                 b"content-type: application/json\r\ncontent-length: 2\r\n\r\n")
    assert read_response(sock).startswith(b"HTTP/1.1 401 ")
    sock.sendall(b"{}")  # the body ends after the answer; the connection is now idle
    began = time.monotonic()
    answer, waited = read_until_closed(sock, LIMIT_S + SLACK_S)
    assert answer == b"" and waited < LIMIT_S + SLACK_S, "the idle connection was never closed"
    assert time.monotonic() - began < LIMIT_S + SLACK_S


def test_a_body_never_sent_after_its_answer_gets_no_second_answer(slow_gw):
    """Refused before its body was read (a bad key), the client never sends the body: when the
    body's deadline passes, the connection is only closed, with no 408 after the 401 and no
    second audit line."""
    before = len(slow_gw.audit())
    sock = slow_gw.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer nope\r\n"
                 b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{")
    assert read_response(sock).startswith(b"HTTP/1.1 401 ")
    rest, waited = read_until_closed(sock, LIMIT_S + SLACK_S)
    assert rest == b"", rest[:200]
    assert waited < LIMIT_S + SLACK_S
    time.sleep(0.5)
    assert len(slow_gw.audit()) == before + 1, slow_gw.audit()[before:]


def test_a_huge_head_is_refused_without_being_buffered(slow_gw):
    before = slow_gw.rss_mb()
    sock = slow_gw.connect()
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nx-padding: ")
    sent, block = 0, b"a" * 65536
    sock.settimeout(5)
    try:
        while sent < 100 * 2**20:  # 100 MB, the review's probe
            sent += sock.send(block)
    except (ConnectionError, BrokenPipeError, TimeoutError):
        pass
    answer, _ = read_until_closed(sock, 5)
    assert sent < 50 * 2**20, f"the gateway read {sent} bytes of one request head"
    if answer:
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert error_of(answer)["code"] == "request_header_too_large"
    assert_audited(slow_gw, 431, "request_header_too_large")
    assert slow_gw.rss_mb() - before < 20
    assert slow_gw.completion().status_code == 200


def tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


TCP_CLOSE = 7  # what a reset leaves; bytes already received can still be read after it


def test_a_stream_read_at_one_byte_a_second_ends_and_frees_its_slot(slow_gw):
    before = slow_gw.rss_mb()
    sock = slow_gw.connect(rcvbuf=4096)
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 100_000, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + slow_gw.key.encode() + b"\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    began = time.monotonic()
    sock.settimeout(5)
    assert sock.recv(1) == b"H"
    while tcp_state(sock) != TCP_CLOSE:
        assert time.monotonic() - began < LIMIT_S + 3 * SLACK_S, "the slow reader was never cut off"
        time.sleep(1.0)
        sock.recv(1)  # a byte a second
    sock.close()
    assert slow_gw.rss_mb() - before < 20, "the gateway buffered the stream for its slow reader"
    assert slow_gw.completion().status_code == 200, "the key's only concurrency slot was not released"


def test_a_large_answer_read_steadily_but_slowly_is_not_cut_off(slow_gw):
    """--timeout-send is about a client that stops reading, not one on a slow link: a body
    that takes several timeouts to download at about 2 MB/s arrives whole."""
    sock = slow_gw.connect(rcvbuf=4096)
    body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 800_000}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + slow_gw.key.encode() + b"\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock.settimeout(5)
    data, began = b"", time.monotonic()
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, got = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(got) < length:
        chunk = sock.recv(4096)
        assert chunk, f"cut off after {len(got)} of {length} bytes"
        got += chunk
        time.sleep(0.002)
    assert time.monotonic() - began > 2 * LIMIT_S, "too fast to show anything: make the answer larger"
    assert json.loads(got)["usage"]["completion_tokens"] == 800_000
    sock.close()


def test_behind_its_proxy_one_clients_bad_tokens_do_not_lock_out_another(slow_gw):
    """The shipped deployments trust their proxy's X-Forwarded-For (tests/deploy): each client
    then has its own address and its own failed-authentication budget (20 a minute)."""
    attacker, user = {"x-forwarded-for": "198.51.100.7"}, {"x-forwarded-for": "198.51.100.8"}
    statuses = {httpx.get(f"{slow_gw.url}/v1/models", headers={"authorization": "Bearer nope", **attacker},
                          timeout=10).status_code for _ in range(25)}
    assert statuses == {401, 429}
    response = httpx.get(f"{slow_gw.url}/v1/models", timeout=10,
                         headers={"authorization": f"Bearer {slow_gw.key}", **user})
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    wait_for(lambda: any(r["request_id"] == request_id for r in slow_gw.audit()), 5, "its audit line")
    assert next(r for r in slow_gw.audit() if r["request_id"] == request_id)["client"] == "198.51.100.8"


def test_over_the_concurrency_limit_an_openai_503(slow_gw):
    held = [slow_gw.connect() for _ in range(CONCURRENCY)]
    try:
        sock = slow_gw.connect()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
        answer, _ = read_until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"retry-after: 1" in answer.lower()
        assert error_of(answer)["code"] == "gateway_overloaded"
        sock = slow_gw.connect()
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n")
        assert read_until_closed(sock, 5)[0].startswith(b"HTTP/1.1 503 ")
        assert_audited(slow_gw, 503, "gateway_overloaded")  # the probe above is not audited, this is
    finally:
        for sock in held:
            sock.close()


def test_the_engine_server_refuses_a_huge_head_too(tmp_path):
    """The engine's uvicorn (engine/server/run.py), on its Unix socket: its token is checked
    only once the head is read, so the head must be small to be read at all."""
    from fastapi import FastAPI

    from portcullis.engine.server.run import ServerThread, bind_unix_socket

    app = FastAPI()
    app.get("/health")(lambda: {"ok": True})
    server = ServerThread(app, bind_unix_socket(tmp_path / "e.sock")).start()
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(tmp_path / "e.sock"))
        sock.settimeout(5)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: engine\r\nx-padding: ")
        sent = 0
        with pytest.raises((ConnectionError, BrokenPipeError)):  # noqa: PT012
            while sent < 100 * 2**20:
                sent += sock.send(b"a" * 65536)
        assert sent < 10 * 2**20, f"the engine server read {sent} bytes of one request head"
    finally:
        server.stop()
