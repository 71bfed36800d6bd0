"""`GET /v1/models` and `GET /v1/models/{id}`: the names this server answers to."""
from __future__ import annotations

from fastapi import APIRouter

from portcullis.engine.server.state import ServerState, State

router = APIRouter()


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(state.started_at), "owned_by": "portcullis",
            "max_model_len": state.max_model_len, "weights_sha256": state.weights_sha256,
            # With max_model_len, the longest prompt text that can fit: the gateway refuses longer
            # ones itself, as the engine would, without forwarding megabytes.
            "max_token_chars": state.max_token_chars}


@router.get("/v1/models")
async def list_models(state: State) -> dict:
    return {"object": "list", "data": [_model_card(state, name) for name in state.settings.served_model_names]}


# `:path`, as Hub ids have a slash ("Qwen/Qwen2.5-0.5B-Instruct") and the SDK sends it unescaped.
@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, state: State) -> dict:
    return _model_card(state, state.check_model(model_id))
