"""OpenTelemetry traces, when `--otlp-traces-endpoint` is set (vLLM's flag).

Each request gets a server span in the gateway; when its audit line is written, the span takes
the GenAI semantic conventions' attributes (operation, model, input and output tokens, the
response id) plus the request id, tenant, status and decision: never a prompt, a completion
or a credential. `trace_headers()` is the `traceparent` the engine continues the trace from.
Spans go to the collector over OTLP/HTTP (protobuf) in batches, off the request path.

The opentelemetry SDK and exporter are the optional `otel` extra, imported only when tracing
is on, so a gateway without them runs as before.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

SERVICE_NAME = "portcullis-gateway"
INSTALL_HINT = "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'portcullis-llm[otel]'"
# GenAI semantic conventions' operation names, and the prefix of the engine's response ids.
OPERATIONS = {"/v1/chat/completions": ("chat", "chatcmpl-"), "/v1/completions": ("text_completion", "cmpl-"),
              "/v1/embeddings": ("embeddings", None), "/v1/messages": ("chat", "msg_"),
              "/v1/responses": ("chat", "resp_")}

_tracing = False  # true once this process made a tracer: only then do audit lines look for a span


def add_tracing_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-traces-endpoint", metavar="URL",
                        help="send OpenTelemetry traces to this OTLP/HTTP collector URL, e.g. "
                        "http://otel-collector:4318/v1/traces (needs the otel extra)")


def tracing_argv(args: argparse.Namespace) -> list[str]:
    """The flag as given, for a child gateway or engine."""
    return ["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else []


def tracing_problem() -> str | None:
    """Why tracing cannot start here (the SDK or exporter is not installed), checked at start-up."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def request_tracer(endpoint: str) -> Any:
    global _tracing
    _tracing = True
    return tracer_provider(endpoint).get_tracer("portcullis.gateway")


def tracer_provider(endpoint: str) -> Any:
    """Spans batched to the collector in a background thread, flushed at exit."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


@cache
def _api() -> ModuleType:
    """`opentelemetry.trace`, imported once (an import statement per request costs more)."""
    from opentelemetry import trace

    return trace


@cache
def _context() -> ModuleType:
    from opentelemetry import context

    return context


class RequestSpans:
    """The outermost layer: a span per HTTP request, current while the gateway handles it.

    A client's own `traceparent` is not continued: the gateway is a trust boundary, and a
    client must not choose the trace its requests are filed under.
    """

    def __init__(self, app: ASGIApp, tracer: Any, untraced: Callable[[str, str], bool] = lambda m, p: False) -> None:
        self.app, self.tracer = app, tracer
        self.untraced = untraced  # (method, path) -> true for probes and scrapes: polled, not worth a span
        self.server = _api().SpanKind.SERVER

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.untraced(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        # Named by method until the audit line names the listed route (a raw path would let
        # clients make up span names). What `start_as_current_span` does, without its two
        # generator-based context managers (about 10 us a request).
        api = _api()
        span = self.tracer.start_span(scope["method"], kind=self.server,
                                      attributes={"http.request.method": scope["method"]})
        token = _context().attach(api.set_span_in_context(span))
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(api.Status(api.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            _context().detach(token)
            span.end()


def annotate_request_span(fields: dict[str, Any]) -> None:
    """Copy an audit line's non-secret fields onto the request's span (called as it is written)."""
    if not _tracing:
        return
    span = _api().get_current_span()
    if not span.is_recording():  # not sampled: nothing to fill in
        return
    route, request_id, status = fields.get("route"), fields.get("request_id"), fields.get("status")
    operation, id_prefix = OPERATIONS.get(route or "", (None, None))
    if route:
        span.update_name(f"{fields.get('method')} {route}")
    attributes = {
        "gen_ai.operation.name": operation, "gen_ai.request.model": fields.get("model"),
        "gen_ai.usage.input_tokens": fields.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": fields.get("completion_tokens"),
        "gen_ai.response.id": f"{id_prefix}{request_id}" if id_prefix and fields.get("decision") == "allowed" else None,
        "portcullis.request_id": request_id, "portcullis.tenant": fields.get("tenant"),
        "portcullis.decision": fields.get("decision"), "portcullis.reason": fields.get("reason"),
        "http.route": route, "http.response.status_code": status,
    }
    span.set_attributes({key: value for key, value in attributes.items() if value is not None})
    if isinstance(status, int) and status >= 500:
        span.set_status(_api().Status(_api().StatusCode.ERROR, fields.get("reason")))


def trace_headers() -> list[bytes]:
    """The current span's W3C `traceparent` (and `tracestate`, if it has one), as header lines
    for the engine; none when tracing is off. Written here as the W3C propagator writes them,
    without building a propagator and a carrier for every request."""
    if not _tracing:
        return []
    context = _api().get_current_span().get_span_context()
    if not context.is_valid:
        return []
    lines = [b"traceparent: 00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags)]
    if context.trace_state:
        lines.append(b"tracestate: " + context.trace_state.to_header().encode("ascii"))
    return lines

