"""Build the gateway's FastAPI application from validated settings."""

from __future__ import annotations

import gc
import inspect
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial

import structlog
from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from portcullis import envs
from portcullis.gateway.allowlist import normalise_path
from portcullis.gateway.audit.record import SCOPE_KEY, RequestRecord, new_request_id
from portcullis.gateway.connection import REFUSAL_HOOK, RefusalHook
from portcullis.gateway.errors import NOT_FOUND, Refusal, error_response
from portcullis.gateway.policy.store import PolicyStore
from portcullis.gateway.routers import health, proxy
from portcullis.gateway.settings import GatewaySettings
from portcullis.gateway.state import GatewayState
from portcullis.gateway.telemetry import RequestSpans, request_tracer
from portcullis.gateway.upstream.fleet import DEFAULT_NAME, Fleet, ReplicaConfig
from portcullis.oplog import configure_logging
from portcullis.protocol.channel import ENGINE_TOKEN_ENV

log = structlog.get_logger("portcullis.gateway.app")

SETTINGS_ENV = envs.GATEWAY_SETTINGS.name
PROBES = frozenset({"/healthz", "/readyz"})  # not audited: see gateway.routers.health
PROBE_METHODS = frozenset({"GET", "HEAD"})  # any other method on a probe path is audited as usual
# How long the event loop waits for the GIL while another thread holds it (Python's default is
# 5 ms). The span exporter encodes up to 512 spans at a time (about 25 ms of Python) and the
# audit writer chains lines: with 5 ms slices a request that needs the GIL meanwhile waits up to
# 5 ms at each turn. At one client, side by side: added p99 11.3 -> 5.5 ms, p50 unchanged.
GIL_SWITCH_INTERVAL_S = 0.001


def build_gateway(settings: GatewaySettings) -> GatewayState:
    store = PolicyStore(settings.policy, settings.reload_interval_s)
    default = ReplicaConfig(DEFAULT_NAME, settings.engine_url, settings.engine_token.get_secret_value(), None)
    fleet = Fleet(default, settings.engine_read_timeout_s, settings.upstream_health_interval_s,
                  settings.upstream_scrape_interval_s)
    return GatewayState(settings=settings, store=store, fleet=fleet)


def freeze_startup_objects() -> None:
    """Take what start-up built (modules, the app, the policy) out of the cyclic collector.

    Each full collection otherwise walks those ~75,000 long-lived objects while the event
    loop waits: a 15 to 35 ms stall about once in 10,000 requests, the gateway's own share of
    its latency tail. Objects made by requests are still collected as before.
    """
    gc.collect()  # what is already garbage should be freed, not frozen
    gc.freeze()


class AuditEveryResponse:
    """The outer layer: every response is audited once and carries an OpenAI error body.

    Only the probes reach FastAPI (`ProbesOrProxy`); should anything answer without a record
    of ours (FastAPI's own body, no audit line), the answer is dropped here and replaced by
    ours, audited; so is an error that escapes the app before it answered. Every response also echoes the client's own
    request id, when it sent a sane one, as `x-client-request-id`: `x-request-id` is always
    the gateway's id, the one in the audit line and the engine's logs.
    """

    def __init__(self, app: ASGIApp, gateway: GatewayState) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES and scope["method"] in PROBE_METHODS:
            await self.app(scope, receive, send)
            return
        answered = False
        foreign: int | None = None  # the status of an answer no route of ours gave

        async def relay(message: Message) -> None:
            nonlocal answered, foreign
            if answered:  # the hot path: each chunk of a stream
                await send(message)
            elif message["type"] == "http.response.start":
                record: RequestRecord | None = scope.get(SCOPE_KEY)
                if record is None:
                    foreign = message["status"]
                    return
                answered = True
                await send(_echo_client_id(message, record))

        try:
            await self.app(scope, receive, relay)
        except Exception:
            if answered:
                raise  # mid-response: the server can only close the connection
            record = self._record(scope)  # the answer below carries the same id
            log.exception("gateway_unhandled_error", path=scope.get("path"), request_id=record.request_id)
            foreign = 500
        if answered or foreign is None and _audited(scope):
            return  # answered, or audited unanswered on purpose: the client hung up first
        await self._answer(scope, receive, relay, foreign or 500)

    def _record(self, scope: Scope) -> RequestRecord:
        """The request's audit record, opened here when no route of ours opened one."""
        return scope.get(SCOPE_KEY) or RequestRecord.start(Request(scope), self.gateway)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, status: int) -> None:
        record = self._record(scope)
        if status >= 500:  # nothing about what lies behind: every other miss is the usual 404
            refusal, decision = Refusal(500, "Internal gateway error.", "internal_error"), "failed"
        else:
            refusal, decision = NOT_FOUND, "denied"
        record.refused(refusal, decision)
        path = normalise_path(scope.get("raw_path") or scope["path"].encode()) or ""
        await error_response(refusal, record.request_id, path)(scope, receive, send)


class ProbesOrProxy:
    """The one way in, inside the audit layer: a probe (GET or HEAD on /healthz or /readyz) goes
    to FastAPI's health routes, every other request to the proxy pipeline as a plain ASGI app.
    FastAPI's router and dependency solving, with two more wrapping layers, would add about
    80 us to the ~1 ms of CPU a request costs the gateway at one client on a 2-core machine."""

    def __init__(self, app: ASGIApp, gateway: GatewayState) -> None:
        self.app = app
        self.proxied = partial(proxy.serve_proxied, gateway=gateway)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not (scope["path"] in PROBES and scope["method"] in PROBE_METHODS):
            await self.proxied(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _audited(scope: Scope) -> bool:
    record: RequestRecord | None = scope.get(SCOPE_KEY)
    return record is not None and record.written


def _echo_client_id(message: Message, record: RequestRecord) -> Message:
    if record.client_request_id is None:
        return message
    header = (b"x-client-request-id", record.client_request_id.encode())
    return {**message, "headers": [*message.get("headers", []), header]}


def connection_refusal_auditor(gateway: GatewayState) -> RefusalHook:
    """Audits what the connection refused before any route ran (gateway.connection): a slow or
    oversized request head, bytes that are not HTTP, the concurrency limit. The client is the
    connection's peer: no forwarded-for header has been read yet."""

    def audit(status: int, code: str, client: str, method: str, path: str) -> None:
        if path in PROBES and method in PROBE_METHODS:
            return
        record = RequestRecord(gateway=gateway, request_id=new_request_id(), client_request_id=None,
                               client=client, user_agent="", method=method, path=path)
        record.finish(status, "denied", code)

    return audit


def create_app(settings: GatewaySettings) -> FastAPI:
    configure_logging()
    gateway = build_gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Mapping[str, object]]:
        gateway.store.start()
        await gateway.fleet.start()
        freeze_startup_objects()
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        try:
            yield {REFUSAL_HOOK: connection_refusal_auditor(gateway)}  # read by gateway.connection
        finally:
            gc.unfreeze()  # hand them back, for processes (tests) that go on after the server
            sys.setswitchinterval(switch_interval)
            await gateway.store.stop()
            await gateway.close()

    # No docs, no OpenAPI schema: the gateway must not describe what sits behind it.
    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, **_no_fastapi_telemetry())
    app.state.gateway = gateway
    app.include_router(health.router)  # the probes: every other request goes to the proxy (ProbesOrProxy)
    app.add_middleware(ProbesOrProxy, gateway=gateway)
    app.add_middleware(AuditEveryResponse, gateway=gateway)
    if settings.otlp_traces_endpoint:  # outermost: its span is current while the request is audited
        app.add_middleware(RequestSpans, tracer=request_tracer(settings.otlp_traces_endpoint),
                           untraced=partial(_polled, gateway))
    return app


def _no_fastapi_telemetry() -> dict[str, object]:
    """FastAPI's own OpenTelemetry layer, in releases that have one, off. The gateway makes its
    own spans (gateway.telemetry), with nothing of a request's body in them; that layer would
    add spans, metrics and exception logs to any global provider a host process set up, and it
    looks the three global providers up on every request to find out whether one is (about
    17 us a request on a busy 2-core machine)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def _polled(gateway: GatewayState, method: str, path: str) -> bool:
    """Probes and metrics scrapes: every few seconds from every prober, so no span (they would
    bury the traces of requests)."""
    return method in PROBE_METHODS and (path in PROBES or path == gateway.store.current.policy.metrics.path)


def create_app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` worker processes: settings come via the environment.

    The token travels in its own variable so the settings JSON can be logged when debugging.
    """
    data = json.loads(os.environ[SETTINGS_ENV])
    data["engine_token"] = os.environ[ENGINE_TOKEN_ENV]
    return create_app(GatewaySettings.model_validate(data))
