"""The catch-all route: every request that is not a probe comes through here, in order:

allowlist -> failed-auth throttle -> authentication -> route scope -> body -> model and caps
-> rate limits -> prompt length -> forward. Each refusal is one audit line; so is each
forwarded request, written when its response ends.
"""

from __future__ import annotations

from urllib.parse import quote

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway import body as bodies
from gateway.access import Access, access_for
from gateway.allowlist import MODELS_PATH, match_route, model_in_path, normalise_path, route_permits
from gateway.auth.principal import Principal
from gateway.auth.resolve import authenticate, credential_tag, credentials_in_query
from gateway.deps import Gateway
from gateway.errors import NOT_FOUND, Refusal, error_response
from gateway.forward import ForwardResponse, Upstream
from gateway.policy.loader import LoadedPolicy
from gateway.record import RequestRecord
from gateway.state import Gateway as GatewayState

log = structlog.get_logger("gateway.proxy")
router = APIRouter()

ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@router.api_route("/{path:path}", methods=ALL_METHODS, include_in_schema=False)
async def proxy(request: Request, gateway: Gateway) -> Response:
    record = RequestRecord.start(request, gateway)
    try:
        _check_audit_writable(gateway)
        return await _handle(request, gateway, record)
    except Refusal as refusal:
        record.refused(refusal, decision="failed" if refusal.status == 499 else "denied")
        return error_response(refusal, record.request_id)
    except Exception:
        log.exception("gateway_internal_error", request_id=record.request_id)
        refusal = Refusal(500, "Internal gateway error.", "internal_error")
        record.refused(refusal, decision="failed")
        return error_response(refusal, record.request_id)


def _check_audit_writable(gateway: GatewayState) -> None:
    """Fail closed: while audit lines cannot be written, nothing is served (unless the policy
    says to serve unaudited). The log itself retries and says when it can write again."""
    if gateway.refusing_unaudited():
        raise Refusal(503, "The gateway cannot write its audit log, so it is not serving requests "
                      "right now; retry shortly.", "audit_unavailable", headers={"retry-after": "5"})


async def _handle(request: Request, gateway: GatewayState, record: RequestRecord) -> Response:
    loaded = gateway.store.current  # this request's policy, whatever reloads happen meanwhile
    if credentials_in_query(request.scope.get("query_string", b"")):
        raise Refusal(401, "Credentials are not accepted in the URL; use the Authorization header.",
                      "credentials_in_query")
    raw_path = request.scope.get("raw_path") or request.url.path.encode()
    path = normalise_path(raw_path)
    if request.method == "GET" and path == loaded.policy.metrics.path:
        return await _metrics(request, gateway, record, loaded)
    route = match_route(loaded.policy, request.method, path)
    model_id = model_in_path(raw_path) if route is None and request.method == "GET" else None
    if model_id:  # one model's card (models.retrieve) is the listing narrowed to one entry
        route = match_route(loaded.policy, "GET", MODELS_PATH)
    if route is None:
        raise NOT_FOUND
    record.route = MODELS_PATH + "/{model}" if model_id else route.path  # audited even if auth fails
    principal = await _authenticate(request, gateway, record, loaded)
    if not route_permits(route, principal):
        raise NOT_FOUND
    return await _forward(request, gateway, record, loaded, principal, route.path, model_id)


async def _authenticate(
    request: Request, gateway: GatewayState, record: RequestRecord, loaded: LoadedPolicy
) -> Principal:
    try:
        principal = await authenticate(request.headers, loaded, gateway.jwks, gateway.clock())
    except Refusal as refusal:
        record.auth_failed = True
        record.principal = refusal.principal
        # Throttled only once it failed: a good credential is never held back by its neighbours.
        limit = loaded.policy.rate_limits.auth_failures_per_minute
        await gateway.auth_failures.failed(record.client, credential_tag(request.headers), limit)
        raise
    record.principal = principal
    return principal


async def _metrics(
    request: Request, gateway: GatewayState, record: RequestRecord, loaded: LoadedPolicy
) -> Response:
    record.route = loaded.policy.metrics.path
    scope = loaded.policy.metrics.scope
    if scope is not None:
        principal = await _authenticate(request, gateway, record, loaded)
        if scope not in principal.scopes:
            raise NOT_FOUND
    record.finish(200, "allowed", "ok")
    return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4",
                    headers={"x-request-id": record.request_id})


async def _forward(
    request: Request, gateway: GatewayState, record: RequestRecord, loaded: LoadedPolicy,
    principal: Principal, path: str, model_id: str | None = None,
) -> Response:
    access = access_for(loaded, principal)
    upstream = await _upstream(request, gateway, record, loaded, principal, access, path, model_id)
    on_error = loaded.policy.rate_limits.on_storage_error
    admission = await gateway.limiter.admit(principal, access, upstream.reserve_tokens, upstream.sequences, on_error)
    try:
        await _check_prompt_length(gateway, record, upstream, access)
    except BaseException:
        await admission.limiter.release(admission)
        raise
    return ForwardResponse(record, admission, upstream)


async def _upstream(
    request: Request, gateway: GatewayState, record: RequestRecord, loaded: LoadedPolicy,
    principal: Principal, access: Access, path: str, model_id: str | None = None,
) -> Upstream:
    if request.method not in BODY_METHODS:
        if model_id:  # one model's card: refused as a request naming the model would be
            record.model = model_id[:200]
            if not access.allows_model(model_id):
                raise bodies.model_refusal(model_id, loaded.policy.hide_unknown_models)
            path = f"{MODELS_PATH}/{quote(model_id, safe='/')}"
        return Upstream(request.method, path, None, False, False, access, 0)
    raw = await bodies.read_body(request, access.max_body_bytes)
    policy = loaded.policy
    salt = gateway.cache_salt(principal.tenant) if access.cache_scope == "tenant" else None
    payload = bodies.parse_json(raw)
    # Known before any check can refuse, so refusals are audited with what was asked for.
    record.model = str(payload["model"])[:200] if "model" in payload else None
    record.stream = payload.get("stream") is True
    prepared = bodies.prepare(payload, access, policy.hide_unknown_models,
                              policy.max_tokens_over_cap, salt, policy.audit.log_prompts, path)
    record.model, record.stream, record.prompt_fields = prepared.model, prepared.stream, prepared.prompt_fields
    count_body = None
    if bodies.needs_token_count(prepared, access.max_prompt_tokens):
        count_body = bodies.prompt_count(prepared.payload)
    return Upstream(request.method, path, prepared.encode(), prepared.stream,
                    prepared.strip_usage_chunk, access, prepared.prompt_bytes, count_body,
                    sequences=prepared.sequences, reserve_tokens=prepared.reserve_tokens)


async def _check_prompt_length(
    gateway: GatewayState, record: RequestRecord, upstream: Upstream, access: Access
) -> None:
    cap, counting = access.max_prompt_tokens, upstream.prompt_count
    if counting is None or cap is None:
        return
    count = counting.known
    for body in counting.bodies:
        count = max(count, await _tokens_in(gateway, record, body))
    if count > cap:
        raise Refusal(400, f"The prompt has {count} tokens; the limit here is {cap}.",
                      "prompt_too_long", param=counting.param)


async def _tokens_in(gateway: GatewayState, record: RequestRecord, body: bytes) -> int:
    try:
        response = await gateway.engine.post_json("/tokenize", body, record.request_id)
        count = int(response.json()["count"]) if response.status_code == 200 else None
    except Exception:  # noqa: BLE001 - any failure here means we cannot vouch for the prompt
        count = None
    if count is None:
        raise Refusal(503, "Could not measure the prompt; retry shortly.", "prompt_count_unavailable",
                      headers={"retry-after": "1"})
    return count
