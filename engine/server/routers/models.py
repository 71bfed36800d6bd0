"""`GET /v1/models`: the names this server answers to."""
from __future__ import annotations

from fastapi import APIRouter

from engine.server.state import State

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: State) -> dict:
    created = int(state.started_at)
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "portcullis",
         "max_model_len": state.max_model_len}
        for name in state.settings.served_model_names
    ]
    return {"object": "list", "data": data}
