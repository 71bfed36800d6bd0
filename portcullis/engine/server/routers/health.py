"""`GET /health` (the only route without the token: for supervisors and load tools) and
`GET /version`."""
from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from portcullis import DISTRIBUTION
from portcullis.engine.server.errors import error_body
from portcullis.engine.server.state import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    if not state.engine.is_alive:
        return JSONResponse(error_body(503, "the engine is not running", code="engine_unavailable"), 503)
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> dict:
    try:
        return {"version": metadata.version(DISTRIBUTION)}
    except metadata.PackageNotFoundError:
        return {"version": "unknown"}
