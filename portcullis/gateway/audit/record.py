"""`RequestRecord`: everything the audit line needs, gathered as a request moves through.

`finish` is the single exit: it counts the metrics and hands the one audit line to the log's
writer, and a second call is ignored, so no path can log a request twice.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.errors import Refusal
from portcullis.gateway.state import GatewayState
from portcullis.gateway.telemetry import annotate_request_span

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
RATE_LIMIT_REASONS = frozenset({"request_rate_limit", "token_rate_limit", "concurrency_limit", "auth_rate_limit",
                                "token_budget", "request_budget"})
SCOPE_KEY = "portcullis.record"  # where a request's record sits in its ASGI scope


def new_request_id() -> str:
    """The gateway's own id for a request: its audit line's, its `x-request-id`, the engine's."""
    return uuid.uuid4().hex


def client_request_id(request: Request) -> str | None:
    """The client's own id for its request (OpenAI's `x-client-request-id`, or the
    `x-request-id` vLLM and proxies send), when it is sane; anything else is ignored."""
    given = request.headers.get("x-client-request-id") or request.headers.get("x-request-id")
    return given if given and REQUEST_ID.match(given) else None


@dataclass
class RequestRecord:
    gateway: GatewayState
    request_id: str  # always ours: clients' ids collide, across tenants too
    client_request_id: str | None
    client: str
    user_agent: str
    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    route: str | None = None
    principal: Principal | None = None
    model: str | None = None
    stream: bool = False
    prompt_fields: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None  # the priority the engine was sent (the policy's floor applied)
    tool_calls: int = 0  # tool calls in the reply: their count only, never their arguments
    upstream: str | None = None  # the replica that served it (its name in the policy)
    retried_from: str | None = None  # the replica whose connection failed first, if any
    weights_sha256: str | None = None  # the served model's identity: its weights, hashed at engine start
    auth_failed: bool = False
    policy_generation: int = 0  # the policy in force when the request came in (0: as started)
    ttfb_ms: float | None = None
    written: bool = False

    @classmethod
    def start(cls, request: Request, gateway: GatewayState) -> RequestRecord:
        """Open the record; the audit log bounds every field, so nothing is cut here."""
        client = request.client.host if request.client else "-"
        record = cls(
            gateway=gateway,
            request_id=new_request_id(),
            client_request_id=client_request_id(request),
            client=client,
            user_agent=request.headers.get("user-agent", ""),
            method=request.method,
            path=request.scope.get("raw_path", b"").decode("latin-1") or request.url.path,
            policy_generation=gateway.store.generation,
        )
        request.scope[SCOPE_KEY] = record  # so the outer layer knows this request is audited
        return record

    def mark_first_byte(self) -> None:
        if self.ttfb_ms is None:
            self.ttfb_ms = round((time.perf_counter() - self.started) * 1000, 3)

    def refused(self, refusal: Refusal, decision: str = "denied") -> None:
        self.finish(refusal.status, decision, refusal.reason)

    def finish(self, status: int, decision: str, reason: str, usage: dict[str, Any] | None = None) -> None:
        if self.written:
            return
        self.written = True
        self._count(status, decision, reason)
        fields = self._fields(status, decision, reason, usage or {})
        annotate_request_span(fields)  # OpenTelemetry, when --otlp-traces-endpoint is set
        self.gateway.audit.write(**fields)

    def _fields(self, status: int, decision: str, reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        p = self.principal
        details = usage.get("prompt_tokens_details") or {}
        fields = {
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "principal": p.id if p else None,
            "key_id": p.key_id if p else None,
            "auth": p.method if p else None,
            "tenant": p.tenant if p else None,
            "client": self.client,
            "user_agent": self.user_agent,
            "method": self.method,
            "path": self.path,
            "route": self.route,
            "model": self.model,
            "stream": self.stream,
            "status": status,
            "decision": decision,
            "reason": reason,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
            "tokens_estimated": bool(usage.get("estimated")),
            "ttfb_ms": self.ttfb_ms,
            "latency_ms": round((time.perf_counter() - self.started) * 1000, 3),
            "policy_generation": self.policy_generation,
            **self.prompt_fields,
        }
        if self.upstream is not None:
            fields["upstream"] = self.upstream
        if self.retried_from is not None:
            fields["retried_from"] = self.retried_from
        if self.weights_sha256 is not None:
            fields["model_weights_sha256"] = self.weights_sha256
        if self.priority is not None:
            fields["priority"] = self.priority
        if self.tool_calls:
            fields["tool_calls"] = self.tool_calls
        return fields

    def _count(self, status: int, decision: str, reason: str) -> None:
        m = self.gateway.metrics
        tenant = self.principal.tenant if self.principal else "-"
        m.requests.labels(self.route or "unlisted", str(status), decision, tenant).inc()
        if reason in RATE_LIMIT_REASONS:
            m.rate_limited.labels(reason, tenant).inc()
        if self.auth_failed:
            m.auth_failures.labels(reason).inc()
