"""`GET /metrics`: Prometheus text exposition of this server's own registry."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from portcullis.engine.server.state import State

router = APIRouter()


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
