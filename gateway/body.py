"""Request-body checks and rewrites: size, JSON, model, max_tokens, prompt, cache salt, usage.

The body the engine receives is the client's JSON with exactly these changes: `max_tokens`
capped (or filled in), `cache_salt` set to the tenant's, and `stream_options.include_usage`
turned on so token limits can be charged from the engine's exact count.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.access import Access
from gateway.errors import Refusal

MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
# Chat templates add role markers and special tokens around the text the client sent.
TEMPLATE_ALLOWANCE_TOKENS = 64


@dataclass
class PreparedBody:
    payload: dict[str, Any]
    model: str | None
    stream: bool
    strip_usage_chunk: bool
    prompt_bytes: int
    prompt_fields: dict[str, Any]

    def encode(self) -> bytes:
        return json.dumps(self.payload, separators=(",", ":"), ensure_ascii=False).encode()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing with 413 as soon as it is known to exceed `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise Refusal(499, "The client closed the request.", "client_disconnected") from None
    return b"".join(chunks)


def _too_large(limit: int) -> Refusal:
    return Refusal(413, f"Request body is larger than {limit} bytes.", "body_too_large")


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise Refusal(400, "The request body is not valid JSON.", "malformed_json") from None
    if not isinstance(payload, dict):
        raise Refusal(400, "The request body must be a JSON object.", "malformed_json")
    return payload


def check_model(payload: dict[str, Any], access: Access, hide: bool) -> str | None:
    model = payload.get("model")
    if model is None:
        if access.any_model:  # only an unrestricted principal may leave it to the engine
            return None
        raise Refusal(400, "The 'model' field is required.", "model_required", param="model")
    if not isinstance(model, str):
        raise Refusal(400, "'model' must be a string.", "malformed_request", param="model")
    if access.allows_model(model):
        return model
    raise model_refusal(model, hide)


def model_refusal(model: str, hide: bool) -> Refusal:
    """What a principal hears of a model it may not use: 403, or, when the policy hides models,
    the 404 the engine gives for a model it does not have."""
    if hide:
        return Refusal(404, f"The model `{model[:100]}` does not exist.", "model_not_found", param="model")
    return Refusal(403, f"You are not allowed to use the model '{model[:100]}'.", "model_not_allowed", param="model")


def cap_max_tokens(payload: dict[str, Any], cap: int | None, over_cap: str) -> None:
    if cap is None or not _generates(payload):
        return
    asked = [(f, payload[f]) for f in MAX_TOKEN_FIELDS if payload.get(f) is not None]
    for field, value in asked:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise Refusal(400, f"'{field}' must be a positive integer.", "malformed_request", param=field)
        if value > cap and over_cap == "reject":
            raise Refusal(400, f"'{field}' is {value}; the limit here is {cap}.", "max_tokens_over_cap", param=field)
        payload[field] = min(value, cap)
    if not asked:  # an absent cap would let the engine run to the context length
        payload["max_tokens"] = cap


def _generates(payload: dict[str, Any]) -> bool:
    return "prompt" in payload or "messages" in payload


def _prompt_of(payload: dict[str, Any]) -> Any:
    return payload.get("messages", payload.get("prompt"))


def prompt_fields(payload: dict[str, Any], log_prompts: bool) -> tuple[int, dict[str, Any]]:
    """(size of the prompt in bytes, what the audit line says about it)."""
    prompt = _prompt_of(payload)
    if prompt is None:
        return 0, {}
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    encoded = text.encode()
    fields: dict[str, Any] = {"prompt_sha256": hashlib.sha256(encoded).hexdigest()}
    if log_prompts:
        fields["prompt"] = prompt
    return len(encoded), fields


def needs_token_count(prompt_bytes: int, cap: int | None) -> bool:
    """A token is at least one byte, so a short prompt is under the cap without tokenizing."""
    return cap is not None and prompt_bytes + TEMPLATE_ALLOWANCE_TOKENS > cap


def tokenize_request(payload: dict[str, Any]) -> bytes:
    keys = ("model", "messages", "prompt", "add_generation_prompt", "chat_template_kwargs")
    return json.dumps({k: payload[k] for k in keys if k in payload}).encode()


def ask_for_usage(payload: dict[str, Any]) -> bool:
    """Turn on the final usage chunk; True when the client did not ask for it itself."""
    if payload.get("stream") is not True:
        return False
    options = payload.get("stream_options")
    if not isinstance(options, dict):
        options = {}
    wanted = options.get("include_usage") is True
    payload["stream_options"] = {**options, "include_usage": True}
    return not wanted


def set_cache_salt(payload: dict[str, Any], salt: str | None) -> None:
    if salt is not None:
        payload["cache_salt"] = salt  # overwrites whatever the client sent


def prepare(payload: dict[str, Any], access: Access, policy_hide: bool, over_cap: str,
            salt: str | None, log_prompts: bool) -> PreparedBody:
    model = check_model(payload, access, policy_hide)
    cap_max_tokens(payload, access.max_tokens, over_cap)
    size, fields = prompt_fields(payload, log_prompts)
    strip = ask_for_usage(payload)
    if _generates(payload) or "cache_salt" in payload:
        set_cache_salt(payload, salt)
    return PreparedBody(payload, model, payload.get("stream") is True, strip, size, fields)
