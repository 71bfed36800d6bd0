"""The proxy pipeline: every request that is not a probe comes through here, in order:

allowlist -> failed-auth throttle -> authentication -> route scope -> body -> model and caps
-> rate limits -> prompt length -> forward. Each refusal is one audit line; so is each
forwarded request, written when its response ends.
"""

from __future__ import annotations

from urllib.parse import quote

import structlog
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from portcullis.gateway import body as bodies
from portcullis.gateway import console
from portcullis.gateway.access import access_for
from portcullis.gateway.allowlist import (
    MODELS_PATH,
    match_route,
    model_in_path,
    normalise_path,
    route_permits,
    stored_response_in_path,
)
from portcullis.gateway.audit.record import RequestRecord
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.auth.resolve import authenticate, credential_tag, credentials_in_query
from portcullis.gateway.errors import NOT_FOUND, Refusal, error_response
from portcullis.gateway.proxy_call import ProxyCall, Upstream
from portcullis.gateway.state import GatewayState
from portcullis.gateway.tls import CLIENT_CERT_KEY
from portcullis.gateway.upstream.fleet import affinity_chain, leading_text
from portcullis.gateway.upstream.forward import Exchange

log = structlog.get_logger("gateway.proxy")

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def serve_proxied(scope: Scope, receive: Receive, send: Send, gateway: GatewayState) -> None:
    """The pipeline as a plain ASGI app, the one way in for every request but the probes'
    (`gateway.app.ProbesOrProxy`): no FastAPI routing or dependency solving on the hot path."""
    answer = await _proxy(Request(scope, receive), gateway)
    if isinstance(answer, Exchange):
        await answer.run(scope, receive, send)  # the engine call, the relay, the audit line
    else:
        await answer(scope, receive, send)  # a refusal or an answer of the gateway's own


async def _proxy(request: Request, gateway: GatewayState) -> Response | Exchange:
    record = RequestRecord.start(request, gateway)
    try:
        await _check_audit_writable(gateway)
        return await _handle(ProxyCall(request, gateway, record, gateway.store.current))
    except Refusal as refusal:
        record.refused(refusal, decision="failed" if refusal.status == 499 else "denied")
        return error_response(refusal, record.request_id, _client_path(request))
    except Exception:
        log.exception("gateway_internal_error", request_id=record.request_id)
        refusal = Refusal(500, "Internal gateway error.", "internal_error")
        record.refused(refusal, decision="failed")
        return error_response(refusal, record.request_id, _client_path(request))


def _client_path(request: Request) -> str:
    """The path a refusal's body is shaped for (Anthropic's envelope on its Messages API): the
    client's own, so the shape says nothing about which routes exist behind the gateway."""
    return normalise_path(request.scope.get("raw_path") or request.url.path.encode()) or ""


async def _check_audit_writable(gateway: GatewayState) -> None:
    """Fail closed: while audit lines cannot be written, or more of them wait for the disk than
    the log's queue holds, nothing is served (unless the policy says to serve unaudited). The
    log itself retries (or drains) and says when it can write again."""
    if await gateway.refusing_unaudited():
        gateway.metrics.audit_refusals.labels(gateway.audit.count_refusal()).inc()
        raise Refusal(503, "The gateway cannot write its audit log, so it is not serving requests "
                      "right now; retry shortly.", "audit_unavailable", headers={"retry-after": "5"})


async def _handle(call: ProxyCall) -> Response | Exchange:
    request, policy, record = call.request, call.policy.policy, call.record
    if credentials_in_query(request.scope.get("query_string", b"")):
        raise Refusal(401, "Credentials are not accepted in the URL; use the Authorization (or x-api-key) header.",
                      "credentials_in_query")
    raw_path = request.scope.get("raw_path") or request.url.path.encode()
    path = normalise_path(raw_path)
    if request.method == "GET" and path == policy.metrics.path:
        return await _metrics(call)
    if request.method in console.METHODS and console.under(path, policy.console.path):
        return await console.serve(call, path, _authenticate)
    route = match_route(policy, request.method, path)
    model_id = model_in_path(raw_path) if route is None and request.method == "GET" else None
    if model_id:  # one model's card (models.retrieve) is the listing narrowed to one entry
        route = match_route(policy, "GET", MODELS_PATH)
    stored = stored_response_in_path(request.method, path) if route is None else None
    if stored:  # who may create responses may read back their tenant's own (the engine keeps them apart)
        route = match_route(policy, "POST", bodies.RESPONSES_PATH)
    if route is None:
        raise NOT_FOUND
    record.route = (MODELS_PATH + "/{model}" if model_id else bodies.RESPONSES_PATH + "/{id}" if stored
                    else route.path)  # audited even if auth fails
    if not route_permits(route, await _authenticate(call)):
        raise NOT_FOUND
    return await _forward(call, path if stored else route.path, model_id)


async def _authenticate(call: ProxyCall) -> Principal:
    request, gateway, record = call.request, call.gateway, call.record
    try:
        principal = await _principal(call)
    except Refusal as refusal:
        record.auth_failed = True
        record.principal = refusal.principal
        # Throttled only once it failed: a good credential is never held back by its neighbours.
        limit = call.policy.policy.rate_limits.auth_failures_per_minute
        await gateway.auth_failures.failed(record.client, credential_tag(request.headers), limit)
        raise
    call.principal = record.principal = principal
    return principal


async def _principal(call: ProxyCall) -> Principal:
    request, gateway = call.request, call.gateway
    cert = request.scope.get(CLIENT_CERT_KEY, ())
    try:
        return await authenticate(request.headers, call.policy, gateway.jwks, gateway.clock(), cert)
    except Refusal as refusal:
        # A key created a moment ago is in a keys file the poll has not read yet: read it now
        # if it changed (only a stat when it did not), so the new key works on its first try.
        if refusal.reason != "invalid_key" or not await gateway.store.reload_if_changed():
            raise
    call.policy = gateway.store.current  # the rest of the request follows the policy it was let in by
    return await authenticate(request.headers, call.policy, gateway.jwks, gateway.clock(), cert)


async def _metrics(call: ProxyCall) -> Response:
    metrics, record = call.policy.policy.metrics, call.record
    record.route = metrics.path
    if metrics.scope is not None:
        principal = await _authenticate(call)
        if metrics.scope not in principal.scopes:
            raise NOT_FOUND
    record.finish(200, "allowed", "ok")
    return Response(call.gateway.metrics.render(), media_type="text/plain; version=0.0.4",
                    headers={"x-request-id": record.request_id})


async def _forward(call: ProxyCall, path: str, model_id: str | None) -> Exchange:
    principal = call.principal
    assert principal is not None  # authenticated by _handle
    access = call.access = access_for(call.policy, principal)
    upstream = call.upstream = await _upstream(call, path, model_id)
    on_error = call.policy.policy.rate_limits.on_storage_error
    admission = call.admission = await call.gateway.limiter.admit(
        principal, access, upstream.reserve_tokens, upstream.sequences, on_error)
    try:
        await _check_prompt_length(call)
    except BaseException:
        await admission.limiter.release(admission)
        raise
    return Exchange(call)


async def _upstream(call: ProxyCall, path: str, model_id: str | None) -> Upstream:
    request, record, access, policy = call.request, call.record, call.access, call.policy.policy
    assert access is not None and call.principal is not None  # set by _forward
    if request.method not in BODY_METHODS:
        if model_id:  # one model's card: refused as a request naming the model would be
            record.model = model_id[:200]
            if not access.allows_model(model_id):
                raise bodies.model_refusal(model_id, policy.hide_unknown_models)
            path = f"{MODELS_PATH}/{quote(model_id, safe='/')}"
            _check_served(call, model_id)
        return Upstream(request.method, path, None, False, False, 0, model=model_id)
    raw = await bodies.read_body(request, access.max_body_bytes)
    salt = call.gateway.cache_salt(call.principal.tenant) if access.cache_scope == "tenant" else None
    payload = bodies.parse_json(raw)
    # Known before any check can refuse, so refusals are audited with what was asked for.
    record.model = str(payload["model"])[:200] if "model" in payload else None
    record.stream = payload.get("stream") is True
    prepared = bodies.prepare(payload, access, policy.hide_unknown_models, policy.max_tokens_over_cap, salt,
                              call.gateway.prompt_audit(policy.audit.log_prompts), path)
    record.model, record.stream, record.prompt_fields = prepared.model, prepared.stream, prepared.prompt_fields
    record.priority = prepared.priority
    _check_served(call, prepared.model)
    fleet = call.gateway.fleet
    longest = bodies.longest_text(prepared.payload, path)
    if longest is not None and longest[0] > bodies.FIT_CHECK_CHARS:
        bodies.check_fits(longest, await fleet.prompt_chars(prepared.model))
    if prepared.open_ended:
        bodies.bound_open_ended(prepared, await fleet.context_length(prepared.model))
    chain = affinity_chain(leading_text(_rendered(prepared.payload, path)), salt) if fleet.listed else ()
    count_body = None
    if bodies.needs_token_count(prepared, access.max_prompt_tokens):
        count_body = bodies.prompt_count(prepared.payload, path, access.max_prompt_tokens or 0)
    return Upstream(request.method, path, prepared.encode(), prepared.stream,
                    prepared.strip_usage_chunk, prepared.prompt_bytes, count_body,
                    sequences=prepared.sequences, reserve_tokens=prepared.reserve_tokens,
                    model=prepared.model, affinity=chain)


def _rendered(payload: dict, path: str) -> dict:
    """What the engine's template renders first: an Anthropic request's `system`, then its
    messages; a Responses API request's `instructions`, then its input."""
    if path in bodies.MESSAGES_PATHS:
        return {"messages": bodies.chat_messages(payload)}
    if path == bodies.RESPONSES_PATH:
        return {"messages": bodies.as_chat_messages(payload)}
    return payload


def _check_served(call: ProxyCall, model: str | None) -> None:
    """A model no upstream is listed for gets the engine's own 404, as a model the one engine
    of --engine-url does not have would."""
    if model is not None and not call.gateway.fleet.knows(model):
        raise Refusal(404, f"The model `{model[:100]}` does not exist.", "model_not_found", param="model")


async def _check_prompt_length(call: ProxyCall) -> None:
    assert call.access is not None and call.upstream is not None  # set by _forward
    cap, counting = call.access.max_prompt_tokens, call.upstream.prompt_count
    if counting is None or cap is None:
        return
    count = counting.known
    if counting.known_suffix is not None:  # token-id prefixes carry the FIM suffix and markers too
        count += await _tokens_in(call, counting.known_suffix, counting.route)
    for body in counting.bodies:
        count = max(count, await _tokens_in(call, body, counting.route))
    if count > cap:
        raise Refusal(400, f"The prompt has {count} tokens; the limit here is {cap}.",
                      "prompt_too_long", param=counting.param)


async def _tokens_in(call: ProxyCall, body: bytes, route: str) -> int:
    """The prompt's tokens as the engine counts them: `/tokenize`, or Anthropic's count_tokens."""
    assert call.upstream is not None  # set by _forward
    replica = call.gateway.fleet.pick(call.upstream.model)
    try:
        if replica is None:
            raise LookupError("no healthy replica")
        response = await replica.client.post_json(route, body, call.record.request_id, call.tenant_tag)
        count = int(response.json()[bodies.COUNT_FIELDS[route]]) if response.status_code == 200 else None
        refused = response.json().get("error") if response.status_code == 400 else None
    except Exception:  # noqa: BLE001 - any failure here means we cannot vouch for the prompt
        count, refused = None, None
    if isinstance(refused, dict):  # the engine cannot run this prompt at all: the client's to fix
        raise Refusal(400, str(refused.get("message", "The engine refused the prompt."))[:1000],
                      "invalid_request", param=refused.get("param") if isinstance(refused.get("param"), str) else None)
    if count is None:
        raise Refusal(503, "Could not measure the prompt; retry shortly.", "prompt_count_unavailable",
                      headers={"retry-after": "1"})
    return count
