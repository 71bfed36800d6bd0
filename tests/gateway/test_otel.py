"""OpenTelemetry traces (`--otlp-traces-endpoint`): the gateway's span and the real engine's
span, captured by the SDK's in-memory exporter, carry the same request id; the gateway's has
the GenAI attributes (model, tokens, response id, tenant) and never the prompt; the engine's
continues the trace named by a `traceparent` header."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from portcullis.engine.config import EngineConfig
from portcullis.engine.core.engine_core import EngineCore
from portcullis.engine.server import ServerSettings, create_app
from portcullis.engine.server.run import ServerThread, bind_unix_socket
from portcullis.gateway import telemetry

from .conftest import ENGINE_TOKEN, base_policy

PROMPT = "a secret prompt that must never reach a trace"


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def provider(spans: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider


@pytest.fixture(scope="module")
def engine(checkpoint_factory, provider, tmp_path_factory) -> Any:
    """The real engine server (a tiny random-weight Llama served as "demo") with tracing on."""
    core = EngineCore(EngineConfig(model=str(checkpoint_factory("llama")), served_model_name="demo",
                                   max_model_len=256, kv_cache_memory=16 << 20, seed=0))
    app = create_app(core, ServerSettings(served_model_names=["demo"], token=ENGINE_TOKEN),
                     tracer=provider.get_tracer("portcullis.engine"))
    sock = bind_unix_socket(tmp_path_factory.mktemp("engine") / "engine.sock")
    thread = ServerThread(app, sock).start()
    yield Path(sock.getsockname())
    thread.stop()


@pytest.fixture
def traced_gateway(gateways, engine, provider, spans, monkeypatch):
    monkeypatch.setattr(telemetry, "tracer_provider", lambda endpoint: provider)
    gw = gateways.start(base_policy(), engine_url=f"unix://{engine}",
                        otlp_traces_endpoint="http://collector.invalid:4318/v1/traces")
    spans.clear()
    return gw


def _by_service(spans: InMemorySpanExporter, gateway_spans: int = 1, engine_spans: int = 0) -> tuple[list[Any], list[Any]]:
    """The finished spans of each side; a server span ends just after its response went out, so
    the gateway's may finish a moment after the client has the answer."""
    deadline = time.monotonic() + 10
    while True:
        finished = spans.get_finished_spans()
        gateway = [s for s in finished if s.instrumentation_scope.name == "portcullis.gateway"]
        engine = [s for s in finished if s.instrumentation_scope.name == "portcullis.engine"]
        if len(gateway) >= gateway_spans and len(engine) >= engine_spans or time.monotonic() > deadline:
            return gateway, engine
        time.sleep(0.01)


def test_gateway_and_engine_spans_carry_the_request_id(traced_gateway, spans):
    gw = traced_gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.keys["alice"], max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=1)
    completion, request_id = raw.parse(), raw.headers["x-request-id"]
    gateway_spans, engine_spans = _by_service(spans, engine_spans=1)
    [outer] = gateway_spans
    [inner] = [s for s in engine_spans if s.attributes["url.path"] == "/v1/chat/completions"]
    assert outer.kind is SpanKind.SERVER and outer.name == "POST /v1/chat/completions"
    assert outer.attributes["portcullis.request_id"] == inner.attributes["portcullis.request_id"] == request_id
    assert inner.context.trace_id == outer.context.trace_id  # one trace, gateway to engine
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
    assert outer.attributes["gen_ai.response.id"] == completion.id  # the engine's id for the same request
    assert outer.attributes["gen_ai.operation.name"] == "chat"
    assert outer.attributes["gen_ai.request.model"] == "demo"
    assert outer.attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert outer.attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert outer.attributes["portcullis.tenant"] == "acme"
    assert outer.attributes["http.response.status_code"] == inner.attributes["http.response.status_code"] == 200
    everything = json.dumps([dict(s.attributes) for s in spans.get_finished_spans()])
    assert "secret prompt" not in everything and gw.keys["alice"] not in everything


def test_a_refused_request_has_a_span_without_an_engine_span(traced_gateway, spans):
    gw = traced_gateway
    response = httpx.post(gw.url + "/v1/chat/completions", headers=gw.auth("bob"),
                          json={"model": "other", "messages": [{"role": "user", "content": PROMPT}]})
    assert response.status_code in (403, 404)
    gateway_spans, engine_spans = _by_service(spans)
    [span] = gateway_spans
    assert span.attributes["portcullis.request_id"] == response.headers["x-request-id"]
    assert span.attributes["portcullis.decision"] == "denied" and "gen_ai.response.id" not in span.attributes
    assert not engine_spans


def test_the_engine_continues_the_trace_of_a_traceparent(engine, provider, spans, monkeypatch):
    monkeypatch.setattr(telemetry, "_tracing", True)  # as request_tracer leaves it
    spans.clear()
    parent = provider.get_tracer("portcullis.gateway").start_span("gateway request", kind=SpanKind.SERVER)
    context = parent.get_span_context()
    with trace.use_span(parent, end_on_exit=True):
        headers = dict(line.decode().split(": ", 1) for line in telemetry.trace_headers())
    assert headers["traceparent"] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(engine)), base_url="http://engine") as client:
        response = client.get("/v1/models", headers={**headers, "authorization": f"Bearer {ENGINE_TOKEN}",
                                                      "x-request-id": "req-traced-1"})
    assert response.status_code == 200
    _, [inner] = _by_service(spans, gateway_spans=0, engine_spans=1)
    assert inner.parent is not None and inner.parent.span_id == context.span_id
    assert inner.context.trace_id == context.trace_id
    assert inner.attributes["portcullis.request_id"] == "req-traced-1"


def test_probes_scrapes_and_unauthenticated_engine_calls_make_no_span(traced_gateway, engine, spans):
    gw = traced_gateway
    assert httpx.get(gw.url + "/healthz").status_code == 200
    assert httpx.get(gw.url + "/gateway/metrics", headers=gw.auth("root")).status_code == 200
    forged = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"  # a caller without the engine's token picks a trace
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(engine)), base_url="http://engine") as client:
        assert client.get("/v1/models", headers={"traceparent": forged}).status_code == 401
        token = {"authorization": f"Bearer {ENGINE_TOKEN}"}
        assert client.get("/health", headers=token).status_code == 200
        assert client.get("/metrics", headers=token).status_code == 200
    # A request that is traced, on both sides, shows the capture is live and comes after the others.
    assert httpx.post(gw.url + "/v1/completions", headers=gw.auth("alice"),
                      json={"model": "demo", "prompt": "x", "max_tokens": 1}).status_code == 200
    gateway_spans, engine_spans = _by_service(spans, engine_spans=1)
    assert [s.name for s in gateway_spans] == ["POST /v1/completions"]
    assert [s.attributes["url.path"] for s in engine_spans] == ["/v1/completions"]
    assert all(s.context.trace_id != int("ab" * 16, 16) for s in spans.get_finished_spans())


def test_the_endpoint_flag_is_checked_and_handed_on(tmp_path):
    from pydantic import ValidationError

    from portcullis.gateway.settings import GatewaySettings
    from portcullis.supervisor import serve

    args, engine_flags = serve.build_parser().parse_known_args(
        ["--otlp-traces-endpoint", "http://otel-collector:4318/v1/traces", "--max-model-len", "256"])
    assert telemetry.tracing_argv(args) == ["--otlp-traces-endpoint", "http://otel-collector:4318/v1/traces"]
    assert engine_flags == ["--max-model-len", "256"]  # serve adds tracing_argv to every engine's flags
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\n")
    with pytest.raises(ValidationError, match="not an OTLP/HTTP URL"):
        GatewaySettings(policy=policy, engine_token=ENGINE_TOKEN, otlp_traces_endpoint="otel-collector:4317")
