"""`/healthz` (this process is alive) and `/readyz` (the engine answers its health check).

Probes carry no credentials and reveal nothing but up/down, so they are not audited: a
kubelet polling every few seconds would otherwise drown the reviewers' log.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.deps import Gateway

router = APIRouter()


@router.get("/healthz", include_in_schema=False)
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz", include_in_schema=False)
async def readyz(gateway: Gateway) -> JSONResponse:
    if await gateway.engine.healthy():
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "engine unavailable"}, status_code=503, headers={"retry-after": "1"})
