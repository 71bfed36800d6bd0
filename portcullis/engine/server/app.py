"""The FastAPI application: routers, middleware, error handlers, and the life cycle of the
engine thread and the status log around it."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from portcullis.engine.core.engine_core import EngineCore
from portcullis.engine.frontend.async_engine import AsyncEngine
from portcullis.engine.server.auth import InternalTokenMiddleware
from portcullis.engine.server.body_shape import JsonShapeMiddleware
from portcullis.engine.server.errors import InternalErrors, install_error_handlers
from portcullis.engine.server.identity import weights_sha256
from portcullis.engine.server.logprobs import TokenText
from portcullis.engine.server.metrics import EngineMetrics, StatusReporter
from portcullis.engine.server.routers import (
    chat,
    completions,
    embeddings,
    health,
    messages,
    metrics,
    models,
    responses,
    tokenize,
)
from portcullis.engine.server.settings import ServerSettings
from portcullis.engine.server.state import ServerState, request_id_from
from portcullis.engine.server.streaming import ClientDisconnected


class RequestIdMiddleware:
    """Give every request an id (the client's `x-request-id` when acceptable) and echo it back,
    on errors too, so one id follows a request from the gateway through the engine's logs. The
    weights' hash goes with it, so the gateway's audit line names the weights that answered."""

    def __init__(self, app: ASGIApp, weights_sha256: str | None = None):
        self.app = app
        self.identity = [(b"x-model-weights-sha256", weights_sha256.encode())] if weights_sha256 else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(scope["headers"])
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode()), *self.identity]
            await send(message)

        await self.app(scope, receive, send_with_id)


UNTRACED = frozenset({"/health", "/metrics"})  # polled every few hundred ms: no span each


class TraceSpans:
    """OpenTelemetry (`--otlp-traces-endpoint`): a server span per request, the child of the
    gateway's span named by its `traceparent` header, carrying the request id. It sits inside
    the token check, so only the gateway (which holds the token) can parent a span here."""

    def __init__(self, app: ASGIApp, tracer) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        header = next((value for name, value in scope["headers"] if name == b"traceparent"), None)
        parent = TraceContextTextMapPropagator().extract({"traceparent": header.decode("latin-1")} if header else {})
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"],
                      "portcullis.request_id": scope["state"]["request_id"]}
        with self.tracer.start_as_current_span(f"{scope['method']} {scope['path']}", context=parent,
                                               kind=SpanKind.SERVER, attributes=attributes) as span:
            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_status)


def otlp_tracer(endpoint: str):
    """A tracer batching spans to an OTLP/HTTP collector (the `otel` extra, imported only here)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "portcullis-engine"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("portcullis.engine")


def load_tokenizer(core: EngineCore):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(core.info.tokenizer)


def create_app(core: EngineCore, settings: ServerSettings, tokenizer=None, tracer=None) -> FastAPI:
    """An app serving `core`. The engine thread starts and stops with the app's lifespan.
    With an OpenTelemetry `tracer`, each request gets a span (`TraceSpans`)."""
    engine = AsyncEngine(core)
    metrics_ = EngineMetrics(settings.model_name, lambda: engine.snapshot)
    info = core.info
    metrics_.describe_cache(block_size=info.block_size, num_gpu_blocks=info.num_kv_blocks,
                            enable_prefix_caching=core.config.enable_prefix_caching,
                            cache_dtype=str(core.config.torch_kv_cache_dtype).removeprefix("torch."))
    engine.observer = metrics_
    tokenizer = tokenizer or load_tokenizer(core)
    state = ServerState(
        engine=engine, tokenizer=tokenizer, settings=settings, metrics=metrics_,
        max_model_len=core.info.max_model_len, token_text=TokenText(tokenizer),
        weights_sha256=weights_sha256(core.config.model_path),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        reporter = asyncio.create_task(_report_status(state))
        try:
            yield
        finally:
            reporter.cancel()
            await engine.shutdown()
            for pool in (state.tokenizer_pool, state.grammar_pool):
                pool.shutdown()

    # No /docs, /redoc or /openapi.json: the engine exposes nothing beyond its API.
    app = FastAPI(title="Portcullis engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    for router in (completions.router, chat.router, messages.router, responses.router, embeddings.router,
                   models.router, tokenize.router, health.router, metrics.router):
        app.include_router(router)
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    # Outermost last: the request id exists before the token check, so 401s carry it too.
    app.add_middleware(JsonShapeMiddleware)  # inside the token check: no body is read for a stranger
    if tracer is not None:  # inside the token check: an unauthenticated caller makes no span
        app.add_middleware(TraceSpans, tracer=tracer)
    app.add_middleware(InternalTokenMiddleware, token=settings.token.get_secret_value() if settings.token else None)
    app.add_middleware(InternalErrors)
    app.add_middleware(RequestIdMiddleware, weights_sha256=state.weights_sha256)
    return app


async def _client_gone(_: Request, __: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nobody reads it; the work was already aborted


async def _report_status(state: ServerState) -> None:
    reporter = StatusReporter(lambda: state.engine.snapshot, state.metrics, state.settings.status_interval_s)
    while True:
        await asyncio.sleep(reporter.interval_s)
        reporter.tick()
