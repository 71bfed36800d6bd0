"""Fixtures for gateway tests: a stub engine on a Unix socket, gateways on real loopback
ports (uvicorn in a thread each), test policies with real keys, RSA/EC/HS JWT keys, Redis."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import uvicorn
import yaml
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from portcullis.gateway.app import create_app
from portcullis.gateway.auth.keys import new_key, write_keys_file
from portcullis.gateway.policy.models import KeysFile
from portcullis.gateway.settings import GatewaySettings
from portcullis.testing import stub_engine

ROOT = Path(__file__).resolve().parents[2]
ENGINE_TOKEN = "internal-token-for-tests-0123456789"
HS_SECRET_ENV = "PORTCULLIS_TEST_HS256_SECRET"
HS_SECRET = "hs256-test-secret-that-is-long-enough-0123456789"
ISSUER, AUDIENCE = "https://idp.test", "portcullis"


stub_module = stub_engine


class ServerThread:
    """A uvicorn server on its own event loop in a daemon thread."""

    def __init__(self, app: Any, **where: Any) -> None:
        config = uvicorn.Config(app, log_level="warning", access_log=False, server_header=False,
                                lifespan="on", timeout_graceful_shutdown=1, **where)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.005)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def stub() -> Iterator[Any]:
    """The stub engine, shared by all tests; each test resets its knobs."""
    folder = Path(tempfile.mkdtemp(prefix="ptc-stub-"))
    app, state = stub_module.create_stub_app(ENGINE_TOKEN)
    server = ServerThread(app, uds=str(folder / "engine.sock")).start()
    state.socket = folder / "engine.sock"
    yield state
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _reset_stub(request: pytest.FixtureRequest) -> None:
    if "stub" in request.fixturenames:
        state = request.getfixturevalue("stub")
        state.chunk_delay_s, state.fail_status = 0.0, None
        state.requests.clear()
        state.streams_started = state.streams_finished = state.streams_aborted = 0


@dataclass
class JwtKeys:
    rsa: Any
    ec: Any
    other_rsa: Any

    def jwks(self) -> dict[str, Any]:
        keys = []
        for kid, key in (("rsa-1", self.rsa), ("ec-1", self.ec)):
            entry = json.loads(jwt.algorithms.get_default_algorithms()[
                "RS256" if kid.startswith("rsa") else "ES256"].to_jwk(key.public_key()))
            entry.update(kid=kid, use="sig")
            keys.append(entry)
        return {"keys": keys}

    def token(self, alg: str = "RS256", kid: str | None = None, key: Any = None, **claims: Any) -> str:
        now = int(time.time())
        body = {"sub": "dave", "tenant": "acme", "iss": ISSUER, "aud": AUDIENCE,
                "iat": now, "nbf": now, "exp": now + 300, "scope": "user"}
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None}
        if key is None:
            key = {"RS256": self.rsa, "ES256": self.ec, "HS256": HS_SECRET}[alg]
        kid = kid if kid is not None else {"RS256": "rsa-1", "ES256": "ec-1", "HS256": None}[alg]
        headers = {"kid": kid} if kid else {}
        return jwt.encode(body, key, algorithm=alg, headers=headers)


@pytest.fixture(scope="session")
def jwt_keys() -> JwtKeys:
    return JwtKeys(
        rsa=rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ec=ec.generate_private_key(ec.SECP256R1()),
        other_rsa=rsa.generate_private_key(public_exponent=65537, key_size=2048),
    )


def base_policy() -> dict[str, Any]:
    return {
        "version": 1,
        "routes": [
            {"method": "POST", "path": "/v1/completions"},
            {"method": "POST", "path": "/v1/chat/completions"},
            {"method": "GET", "path": "/v1/models"},
            {"method": "POST", "path": "/tokenize"},
            {"method": "GET", "path": "/metrics", "scopes": ["admin"]},
        ],
        "tenants": {
            "acme": {"models": ["demo", "other"]},
            "globex": {"models": ["*"]},
        },
        "principals": {
            "bob": {"tenant": "acme", "models": ["demo"]},
            "root": {"tenant": "acme", "scopes": ["admin"]},
        },
        "keys_file": "keys.yaml",
        "jwt": {"algorithms": ["RS256", "ES256"], "issuer": ISSUER, "audience": AUDIENCE,
                "jwks_file": "jwks.json", "leeway_seconds": 5},
        "defaults": {"max_tokens": 256, "max_body_bytes": 65536},
        "audit": {"path": "audit.log"},
    }


KEY_HOLDERS = {  # name -> (principal, tenant, scopes)
    "alice": ("alice", "acme", []),
    "alice2": ("alice", "acme", []),
    "bob": ("bob", "acme", []),
    "carol": ("carol", "globex", []),
    "root": ("root", "acme", []),
}


# The gateway's own lines (start, stop, policy reloads, signed checkpoints): tests about requests
# count request lines and the writer's failure notices, so `audit_records` leaves these out.
GATEWAY_EVENTS = frozenset({"gateway_start", "gateway_stop", "policy_reload", "checkpoint", "admin_action"})


def whole_records(text: str) -> list[dict[str, Any]]:
    """The audit lines of a live log: the last one may be caught half-written by the gateway's
    thread (a reader is not locked out of a file being appended to), so only lines that end."""
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def wait_for_workers(audit_log: Path, proc: subprocess.Popen, workers: int, timeout: float = 180) -> None:
    """Until each worker of a `--workers N` gateway has started (its gateway_start audit line):
    the first to answer /healthz may be alone for a while on a busy machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the gateway exited"
        lines = whole_records(audit_log.read_text()) if audit_log.exists() else []
        if len({r["pid"] for r in lines if r.get("event") == "gateway_start"}) >= workers:
            return
        time.sleep(0.1)
    raise AssertionError("the gateway's workers did not start")


@dataclass
class RunningGateway:
    url: str
    folder: Path
    app: Any
    server: ServerThread
    keys: dict[str, str]
    policy: dict[str, Any]
    secrets: list[str] = field(default_factory=list)

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    @property
    def audit_path(self) -> Path:
        return self.folder / "audit.log"

    @property
    def policy_path(self) -> Path:
        return self.folder / "policy.yaml"

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10.0, **kwargs)

    def raw(self, path: str) -> httpx.URL:
        """A URL sent exactly as written (httpx would read '//v1' as a host, or drop '..')."""
        return httpx.URL(self.url).copy_with(raw_path=path.encode())

    def auth(self, name: str = "alice") -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[name]}"}

    def audit_text(self) -> str:
        """The audit file once the gateway's writer has written every line queued so far."""
        self.gateway.audit.flush()
        return self.audit_path.read_text()

    def audit_records(self) -> list[dict[str, Any]]:
        self.gateway.audit.flush()
        if not self.audit_path.exists():
            return []
        return [r for r in whole_records(self.audit_path.read_text()) if r.get("event") not in GATEWAY_EVENTS]

    def gateway_events(self) -> list[dict[str, Any]]:
        """The lines `audit_records` leaves out: start, stop, reloads, checkpoints, admin actions."""
        self.gateway.audit.flush()
        return [r for r in whole_records(self.audit_path.read_text()) if r.get("event") in GATEWAY_EVENTS]

    async def wait_audit(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Audit lines of forwarded requests land when the response ends: poll briefly."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.audit_records()
            if len(records) >= count or time.monotonic() > deadline:
                return records
            await asyncio.sleep(0.01)

    async def call(self, client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, dict[str, Any]]:
        """Send one request; assert it wrote exactly one audit line, for it, with no secret."""
        response = await client.request(method, path, **kwargs)
        rid = response.headers["x-request-id"]
        deadline = time.monotonic() + 10.0
        # Its own lines, by request id: an earlier request's line may still land after this one's.
        while not (mine := [r for r in self.audit_records() if r.get("request_id") == rid]) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(mine) == 1, f"expected one audit line, got {len(mine)}: {mine}"
        record = mine[0]
        self.assert_no_secrets(kwargs.get("headers") or {})
        return response, record

    def assert_no_secrets(self, headers: dict[str, str]) -> None:
        text = self.audit_text()
        presented = [v.split()[-1] for k, v in headers.items() if k.lower() in ("authorization", "x-api-key")]
        secrets = [*self.keys.values(), *(k.split(".")[1] for k in self.keys.values()), ENGINE_TOKEN, *presented]
        for secret in secrets:
            assert secret not in text, "a credential reached the audit log"

    def write_policy(self, policy: dict[str, Any]) -> None:
        self.policy = policy
        write_policy_file(self.policy_path, policy)


def write_policy_file(path: Path, policy: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(policy, sort_keys=False))
    os.replace(tmp, path)


class GatewayFactory:
    def __init__(self, tmp_path: Path, stub: Any, jwt_keys: JwtKeys) -> None:
        self.tmp_path, self.stub, self.jwt_keys = tmp_path, stub, jwt_keys
        self.running: list[RunningGateway] = []
        self.keys: dict[str, str] | None = None

    def _write_keys(self, folder: Path) -> dict[str, str]:
        if self.keys is None:
            tokens, records = {}, []
            for name, (principal, tenant, scopes) in KEY_HOLDERS.items():
                tokens[name], record = new_key(principal, tenant, scopes)
                records.append(record)
            self.records = records
            self.keys = tokens
        write_keys_file(folder / "keys.yaml", KeysFile(keys=self.records))
        return self.keys

    def start(self, policy: dict[str, Any] | None = None, name: str = "gw", **settings: Any) -> RunningGateway:
        folder = self.tmp_path / name
        folder.mkdir()
        policy = policy or base_policy()
        keys = self._write_keys(folder)
        (folder / "jwks.json").write_text(json.dumps(self.jwt_keys.jwks()))
        write_policy_file(folder / "policy.yaml", policy)
        settings.setdefault("engine_url", f"unix://{self.stub.socket}")
        settings.setdefault("reload_interval_s", 0.1)
        config = GatewaySettings(policy=folder / "policy.yaml", engine_token=ENGINE_TOKEN, **settings)
        app = create_app(config)
        server = ServerThread(app, host="127.0.0.1", port=0).start()
        running = RunningGateway(f"http://127.0.0.1:{server.port}", folder, app, server, keys, policy)
        self.running.append(running)
        return running

    def stop(self) -> None:
        for running in self.running:
            running.server.stop()


@pytest.fixture
def gateways(tmp_path: Path, stub: Any, jwt_keys: JwtKeys, monkeypatch: pytest.MonkeyPatch) -> Iterator[GatewayFactory]:
    monkeypatch.setenv(HS_SECRET_ENV, HS_SECRET)
    factory = GatewayFactory(tmp_path, stub, jwt_keys)
    yield factory
    factory.stop()


@pytest.fixture
def gw(gateways: GatewayFactory) -> RunningGateway:
    return gateways.start()


# ---- Redis -------------------------------------------------------------------------------

def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """Redis from PORTCULLIS_TEST_REDIS_URL; else a private redis-server if one is installed.

    Under CI=true an unreachable Redis fails the run: these tests must never quietly skip.
    """
    url = os.environ.get("PORTCULLIS_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    if _redis_answers(url):
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        message = f"Redis is not reachable at {url} and redis-server is not installed"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _redis_answers(url):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"could not start {binary}")
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
