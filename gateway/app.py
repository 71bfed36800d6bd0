"""Build the gateway's FastAPI application from validated settings."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.engine_client import EngineClient
from gateway.oplog import configure_logging
from gateway.policy.store import PolicyStore
from gateway.routers import health, proxy
from gateway.settings import GatewaySettings
from gateway.state import Gateway

SETTINGS_ENV = "PORTCULLIS_GATEWAY_SETTINGS"
TOKEN_ENV = "PORTCULLIS_ENGINE_TOKEN"


def build_gateway(settings: GatewaySettings) -> Gateway:
    store = PolicyStore(settings.policy, settings.reload_interval_s)
    engine = EngineClient(
        settings.engine_url, settings.engine_token.get_secret_value(), settings.engine_read_timeout_s
    )
    return Gateway(settings=settings, store=store, engine=engine)


def create_app(settings: GatewaySettings) -> FastAPI:
    configure_logging()
    gateway = build_gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.store.start()
        try:
            yield
        finally:
            await gateway.store.stop()
            await gateway.close()

    # No docs, no OpenAPI schema: the gateway must not describe what sits behind it.
    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.include_router(health.router)
    app.include_router(proxy.router)  # last: it catches every other path
    return app


def create_app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` worker processes: settings come via the environment.

    The token travels in its own variable so the settings JSON can be logged when debugging.
    """
    data = json.loads(os.environ[SETTINGS_ENV])
    data["engine_token"] = os.environ[TOKEN_ENV]
    return create_app(GatewaySettings.model_validate(data))
