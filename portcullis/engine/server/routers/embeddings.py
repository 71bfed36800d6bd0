"""`POST /v1/embeddings`: one vector per input, as OpenAI's API returns them, from an engine
started with `--runner pooling`. Each input is a prefill-only engine request through the same
scheduler and paged KV cache as generation."""
from __future__ import annotations

import base64
import time
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field

from portcullis.engine.core.engine_core import check_input_length
from portcullis.engine.frontend.async_engine import EngineDeadError, EngineRequest
from portcullis.engine.pooling import PoolingParams
from portcullis.engine.server.errors import APIError, bad_request
from portcullis.engine.server.limits import check_fan_out
from portcullis.engine.server.prompts import truncation_tail
from portcullis.engine.server.protocol import RequestBody, TokenIds
from portcullis.engine.server.state import RequestId, ServerState, State, Tenant, engine_request_id
from portcullis.engine.server.streaming import unless_disconnected
from portcullis.protocol.requests import text_chars

router = APIRouter()


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # vLLM's: keep the last N tokens
    cache_salt: str | None = None  # the gateway's tenant salt, as for generation
    priority: int = 0


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request, state: State, request_id: RequestId,
                            tenant: Tenant) -> dict:
    arrival = time.monotonic()
    model = state.check_model(body.model)
    if state.engine.info.pooling is None:
        raise bad_request("this model generates text and serves no embeddings; start an embedding model "
                          "(or this one with --runner pooling) for /v1/embeddings", "model")
    inputs = _as_list(body.input)
    check_fan_out(1, len(inputs), state.max_num_seqs)
    for item in inputs:  # each input is its own sequence
        state.check_prompt_text(text_chars(item), body.truncate_prompt_tokens, "input")
    token_ids = await state.tokenizer_pool.run(tenant, _tokenize, state.tokenizer, inputs,
                                               body.truncate_prompt_tokens, state.max_token_chars)
    for ids in token_ids:
        if not ids:
            raise bad_request("an input is empty; every input needs at least one token", "input")
        check_input_length(len(ids), state.max_model_len)
    vectors = await unless_disconnected(request, _embed(state, request_id, token_ids, body, arrival))
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)} for i, v in enumerate(vectors)]
    used = sum(len(ids) for ids in token_ids)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": used, "total_tokens": used}}


def _as_list(value) -> list[str] | list[list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("'input' is empty; give a string, a list of strings or token ids", "input")
    return [value] if isinstance(value[0], int) else list(value)


def _tokenize(tokenizer, inputs: list[str] | list[list[int]], k: int | None, max_token_chars: int) -> list[list[int]]:
    """Each input's token ids, only the last `k` when truncated (and only the text they need)."""
    if isinstance(inputs[0], str):
        token_ids = [tokenizer.encode(truncation_tail(text, k, max_token_chars)) for text in inputs]
    else:
        token_ids = [list(ids) for ids in inputs]
    return token_ids if k is None else [ids[-k:] for ids in token_ids]


async def _embed(state: ServerState, request_id: str, token_ids: list[list[int]], body: EmbeddingRequest,
                 arrival: float) -> list:
    engine = state.engine
    if engine.num_waiting + len(token_ids) > state.settings.max_waiting:
        raise APIError(503, "the engine is overloaded: too many requests are waiting; retry shortly",
                       code="overloaded", headers={"Retry-After": "1"})
    base = engine_request_id(request_id)
    params = PoolingParams(body.dimensions)
    requests = [EngineRequest(f"{base}-{i}", ids, params, body.cache_salt, priority=body.priority)
                for i, ids in enumerate(token_ids)]
    try:
        stream = await engine.add(requests, arrival)
    except EngineDeadError as exc:
        raise APIError(503, f"the engine is not serving: {exc}", code="engine_unavailable") from exc
    index = {r.request_id: i for i, r in enumerate(requests)}
    vectors: list = [None] * len(requests)
    try:
        async for out in stream:
            if out.pooled is not None:
                vectors[index[out.request_id]] = out.pooled
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    finally:
        left = [r.request_id for r, v in zip(requests, vectors) if v is None]
        if left:
            engine.abort(left)
    return vectors


def _encode(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes, base64-encoded
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
