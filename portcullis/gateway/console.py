"""The console's JSON API: what a reviewer or an on-call admin reads, without the command line.

    GET {console.path}/api/audit    records that pass the filters, newest first
    GET {console.path}/api/export   the same records, oldest first, as JSON lines or CSV (a download)
    GET {console.path}/api/verify   the chain's verification (the code of `portcullis audit verify`)
    GET {console.path}/api/usage    requests, refusals and tokens per tenant, principal and model,
                                    and per hour (a day) or per day (a month)
    GET {console.path}/api/budgets  each budget of the policy against what the audit log counts
    GET {console.path}/api/keys     the API keys (id, principal, tenant, dates, last use, effective
                                    limits; never a secret or hash)
    GET {console.path}/api/policy   the policy in force: generation, when applied, any refused edit
    GET {console.path}/api/fleet    the engines behind the gateway: health and load
    POST {console.path}/api/keys/{id}/revoke   only for `console.write_scope` (unset: nobody)

Read-only unless the policy names a `console.write_scope`: then its holders may revoke keys of
the policy's keys file (a POST carrying the `x-portcullis-console` header, which no other site
can send without a CORS grant the gateway never gives), each revocation an `admin_action` audit
line with its diff. Reached only by a principal that holds the policy's `console.scope` (default `admin`;
API key, JWT or mTLS as for any route); anyone else gets the gateway's plain 404, so the console
reveals nothing of itself. Each call is one audit line. The log's files are read in a worker
thread, one console query at a time (the next waits its turn): however large the log, the event
loop keeps proxying and a burst of console calls cannot take the thread pool. Every query
parameter is bounded before any file is read.

The pages (`{console.path}`, a single page over the API, and its script and style) ask the same
scope. A browser logs in by HTTP Basic (any user name, the API key or JWT as the password: a
401 here carries the challenge), or by mTLS where configured. No page has an inline script or
style, every asset comes from the gateway (a strict Content-Security-Policy), and a request a
browser marks cross-site (`Sec-Fetch-Site`, or an `Origin` of another host) gets the plain 404,
credentials or not: another site can neither read the console nor make a browser act in it.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import re
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import anyio
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from portcullis.gateway.access import access_for
from portcullis.gateway.audit.review import (
    USAGE_BY,
    Filter,
    parse_time,
    period_range,
    records,
    usage,
    verify,
)
from portcullis.gateway.auth.keys import KeyBook
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.errors import NOT_FOUND, Refusal
from portcullis.gateway.policy.loader import resolve_relative
from portcullis.gateway.proxy_call import ProxyCall
from portcullis.gateway.state import GatewayState

API = "/api/"
LIMIT_DEFAULT, LIMIT_MAX = 100, 1000
VALUE_MAX = 200  # characters in one query value
PROBLEMS_SHOWN = 50
TEXT_FILTERS = ("principal", "tenant", "status", "decision", "model", "reason")

_limiter: anyio.CapacityLimiter | None = None


# The page and its two assets: file, content type. The page names its assets under the prefix.
PAGES = {"": ("index.html", "text/html; charset=utf-8"),
         "/static/console.js": ("console.js", "text/javascript; charset=utf-8"),
         "/static/console.css": ("console.css", "text/css; charset=utf-8")}
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-resource-policy": "same-origin",
    "cache-control": "no-store",
}
CHALLENGE = 'Basic realm="Portcullis", charset="UTF-8"'
METHODS = frozenset({"GET", "POST"})
WRITE_HEADER = "x-portcullis-console"  # a custom header: a cross-origin fetch with it needs a CORS grant
REVOKE = re.compile(r"/api/keys/([a-z0-9]{8,32})/revoke")


def under(path: str | None, prefix: str) -> bool:
    """Whether a normalised path (None: refused by normalisation) is the console's."""
    return path is not None and (path == prefix or path.startswith(prefix + "/"))


async def serve(call: ProxyCall, path: str, authenticate: Callable) -> Response:
    """One console call: cross-site requests and principals without the scope get the plain
    404 whatever the path; then the page, an asset, or an endpoint (its parameters, then the
    read in the console's thread)."""
    console, record = call.policy.policy.console, call.record
    record.route = console.path + "/*"  # audited even if refused, without echoing a guessed path
    if _cross_site(call.request):
        raise NOT_FOUND
    call.request = _basic_as_bearer(call.request)
    try:
        principal = await authenticate(call)
    except Refusal as refusal:
        if refusal.status != 401:
            raise
        raise Refusal(refusal.status, refusal.message, refusal.reason, param=refusal.param,
                      headers={**refusal.headers, "www-authenticate": CHALLENGE}, principal=refusal.principal) from None
    if console.scope not in principal.scopes:
        raise NOT_FOUND
    rest = path[len(console.path):]
    if call.request.method == "POST":
        return await _write(call, principal, rest)
    if rest in PAGES:
        record.route = console.path + rest
        name, media_type = PAGES[rest]
        record.finish(200, "allowed", "ok")
        return Response(_asset(name, console.path), media_type=media_type, headers=_headers(record.request_id))
    if rest == API + "export":
        return _export(call, principal, _bounded(call.request.query_params))
    endpoint = ENDPOINTS.get(rest.removeprefix(API)) if rest.startswith(API) else None
    if endpoint is None:
        raise NOT_FOUND
    record.route = console.path + rest
    params = _bounded(call.request.query_params)
    body = await anyio.to_thread.run_sync(endpoint, call.gateway, params, limiter=_console_limiter())
    record.finish(200, "allowed", "ok")
    return JSONResponse(body, headers=_headers(record.request_id))


async def _write(call: ProxyCall, principal: Principal, rest: str) -> Response:
    """Revoke a key of the keys file: confirmed by the console's header, allowed by the policy's
    write scope, written under the keys file's lock (as `portcullis keys revoke` does), applied
    at once, and audited as an admin action with its diff."""
    console, record = call.policy.policy.console, call.record
    match = REVOKE.fullmatch(rest)
    if match is None:
        raise NOT_FOUND
    record.route = console.path + "/api/keys/{id}/revoke"
    if call.request.headers.get(WRITE_HEADER) != "1":
        raise Refusal(403, f"A console write needs the {WRITE_HEADER}: 1 header (the console's page sends it).",
                      "console_write_unconfirmed")
    if console.write_scope is None or console.write_scope not in principal.scopes:
        raise Refusal(403, "The policy keeps the console read-only for you (console.write_scope).",
                      "console_read_only")
    keys_file = call.policy.policy.keys_file
    if not keys_file:
        raise Refusal(409, "This policy lists no keys_file: revoke keys in the policy file itself.",
                      "keys_not_managed")
    book_path, key_id = resolve_relative(call.policy.path, keys_file), match.group(1)
    try:
        revoked, changed = await anyio.to_thread.run_sync(lambda: KeyBook(book_path).revoke(key_id),
                                                          limiter=_console_limiter())
    except KeyError:
        raise Refusal(404, f"No key {key_id} in the keys file.", "key_not_found") from None
    when = _iso(revoked.revoked_at)
    if changed:
        call.gateway.audit.write(event="admin_action", action="key_revoked", actor=principal.id,
                                 actor_tenant=principal.tenant, via="console", request_id=record.request_id,
                                 key_id=revoked.id, principal=revoked.principal, tenant=revoked.tenant,
                                 diff={"revoked_at": [None, when]})
        await call.gateway.store.reload_if_changed()  # refused from the next request on
    record.finish(200, "allowed", "ok")
    return JSONResponse({"id": revoked.id, "revoked_at": when, "changed": changed},
                        headers=_headers(record.request_id))


EXPORT_COLUMNS = ("time", "request_id", "principal", "tenant", "client", "method", "route", "model", "status",
                  "decision", "reason", "prompt_tokens", "completion_tokens", "cached_tokens", "latency_ms")
EXPORT_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}


def _export(call: ProxyCall, principal: Principal, params: dict[str, str]) -> Response:
    """Every record that passes the filters, oldest first, streamed from the files as it is read
    (a large log is never held in memory); once the last row is out, an `admin_action` line
    says who exported what and how many rows."""
    record, fmt = call.record, params.get("format", "jsonl")
    if fmt not in EXPORT_TYPES:
        raise _bad("format", "give jsonl or csv")
    flt = _filter(params)
    record.route = call.policy.policy.console.path + API + "export"
    audit = call.gateway.audit

    def rows() -> Iterator[bytes]:
        count = 0
        try:
            if fmt == "csv":
                yield _csv_row(EXPORT_COLUMNS)
            for item in records(audit.path, flt):
                count += 1
                yield (_csv_row([item.get(c) for c in EXPORT_COLUMNS]) if fmt == "csv"
                       else json.dumps(item, separators=(",", ":")).encode() + b"\n")
        finally:
            audit.write(event="admin_action", action="audit_exported", actor=principal.id,
                        actor_tenant=principal.tenant, via="console", request_id=record.request_id,
                        format=fmt, rows=count, filters={k: v for k, v in params.items() if k != "format"})

    record.finish(200, "allowed", "ok")
    name = f"portcullis-audit-{_now():%Y%m%dT%H%M%SZ}.{fmt}"
    return StreamingResponse(rows(), media_type=EXPORT_TYPES[fmt], headers={
        **_headers(record.request_id), "content-disposition": f'attachment; filename="{name}"'})


def _csv_row(values) -> bytes:
    """One CSV line; a text cell that a spreadsheet would run as a formula is quoted with '."""
    out = io.StringIO()
    csv.writer(out).writerow(["'" + v if isinstance(v, str) and v[:1] in ("=", "+", "-", "@") else
                              "" if v is None else v for v in values])
    return out.getvalue().encode()


def _headers(request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id, **SECURITY_HEADERS}


def _cross_site(request: Request) -> bool:
    """What a browser marks as coming from another site (a page elsewhere that fetches, posts or
    embeds): never served, so stolen ambient credentials (Basic, client certificates) buy nothing."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return True
    origin = request.headers.get("origin")
    return origin is not None and urlsplit(origin).netloc != request.headers.get("host")


def _basic_as_bearer(request: Request) -> Request:
    """HTTP Basic (a browser's login prompt) carries the key or JWT as its password: the request
    as if it had come as `Authorization: Bearer`, for the one authentication every route uses."""
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return request
    try:
        password = base64.b64decode(encoded, validate=True).decode().partition(":")[2]
    except (binascii.Error, UnicodeDecodeError):
        return request  # authentication refuses it as it is
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"authorization"]
    headers.append((b"authorization", b"Bearer " + password.encode()))
    return Request({**request.scope, "headers": headers}, request.receive)


@cache
def _asset(name: str, prefix: str) -> bytes:
    text = resources.files("portcullis.gateway").joinpath("console_static", name).read_text(encoding="utf-8")
    return text.replace("{{PREFIX}}", prefix).encode()


def _console_limiter() -> anyio.CapacityLimiter:
    global _limiter
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(1)
    return _limiter


def _bounded(query: Mapping[str, str]) -> dict[str, str]:
    params = {}
    for key, value in query.items():
        if len(key) > VALUE_MAX or len(value) > VALUE_MAX:
            raise _bad(key[:40], f"query values are at most {VALUE_MAX} characters")
        params[key] = value
    return params


def _bad(param: str, message: str) -> Refusal:
    return Refusal(400, f"{param}: {message}", "invalid_console_query", param=param)


def _filter(params: dict[str, str]) -> Filter:
    times = {}
    for name in ("since", "until"):
        if name in params:
            try:
                times[name] = parse_time(params[name])
            except ValueError:
                raise _bad(name, "give an ISO 8601 time, e.g. 2026-12-06T09:00:00Z") from None
    return Filter(**times, **{name: params[name] for name in TEXT_FILTERS if params.get(name)})


def _limit(params: dict[str, str]) -> int:
    text = params.get("limit", str(LIMIT_DEFAULT))
    if not text.isdigit() or not 1 <= int(text) <= LIMIT_MAX:
        raise _bad("limit", f"give a whole number from 1 to {LIMIT_MAX}")
    return int(text)


def audit_records(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """The newest `limit` records that pass the filters (live file and rotations), and how many passed."""
    flt, limit = _filter(params), _limit(params)
    newest: deque[dict[str, Any]] = deque(maxlen=limit)
    matched = 0
    for record in records(gateway.audit.path, flt):
        matched += 1
        newest.append(record)
    return {"matched": matched, "records": list(reversed(newest))}


def chain(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """The whole log checked as `portcullis audit verify` checks it, with the gateway's keyring."""
    verdict = verify(gateway.audit.path, keyring=gateway.keyring, backups=gateway.audit.file.backups)
    return {"status": "verified" if verdict.ok else "tampered", "lines": verdict.lines,
            "keyed_lines": verdict.keyed, "checkpoints": verdict.checkpoints, "head": verdict.head,
            "first_bad": verdict.first_bad, "problems": verdict.problems[:PROBLEMS_SHOWN],
            "notes": verdict.notes[:PROBLEMS_SHOWN], "checked_at": _now().isoformat()}


def usage_rows(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """Chargeback rows for a UTC period (`day`, `month`, `2026-12`, `2026-12-06`; default the
    current day), grouped `by` any of tenant, principal, model (comma-separated), and the same
    per hour or day; requests for the engine only (see _traffic)."""
    period = params.get("period", "day")
    try:
        start, end = period_range(period, _now())
    except ValueError as exc:
        raise _bad("period", str(exc)) from None
    by = tuple(params.get("by", ",".join(USAGE_BY)).split(","))
    if not by or len(set(by)) != len(by) or not set(by) <= set(USAGE_BY):
        raise _bad("by", f"give some of {', '.join(USAGE_BY)}, comma-separated")
    items = list(_traffic(gateway, Filter(since=start, until=end)))
    return {"period": {"start": start.isoformat(), "end": end.isoformat()}, "by": list(by),
            "rows": usage(iter(items), by), "series": _series(items, start, end)}


def _traffic(gateway: GatewayState, flt: Filter) -> Iterator[dict[str, Any]]:
    """The records of requests for the engine: the gateway's own pages (this console, its
    metrics) are neither usage nor charged to a budget."""
    policy = gateway.store.current.policy
    own = (policy.console.path + "/", policy.console.path, policy.metrics.path)
    for item in records(gateway.audit.path, flt):
        route = str(item.get("route") or "")
        if route not in own[1:] and not route.startswith(own[0]):
            yield item


def _series(items: list[dict[str, Any]], start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Requests, refusals and reported tokens per hour of a day, or per day of a month."""
    step_s = 3600 if (end - start).days <= 1 else 86400
    buckets = [{"start": datetime.fromtimestamp(t, timezone.utc).isoformat(), "requests": 0, "denied": 0,
                "tokens": 0} for t in range(int(start.timestamp()), int(end.timestamp()), step_s)]
    for item in items:
        try:
            at = int((parse_time(str(item.get("time"))) - start).total_seconds()) // step_s
        except ValueError:
            continue
        if 0 <= at < len(buckets):
            denied = item.get("decision") == "denied"
            buckets[at]["denied" if denied else "requests"] += 1
            if not item.get("tokens_estimated"):
                buckets[at]["tokens"] += int(item.get("prompt_tokens") or 0) + int(item.get("completion_tokens") or 0)
    return buckets


def budgets(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """Every budget the policy sets, per tenant and per key, against this period's use as the
    audit log counts it (reported tokens; the gateway's own counters also hold reservations of
    requests still running)."""
    loaded, now = gateway.store.current, _now()
    scopes = [("tenant", name, name, None, rule.limits.budgets) for name, rule in loaded.policy.tenants.items()]
    for key in loaded.keys.values():
        access = access_for(loaded, Principal(key.principal, key.tenant, frozenset(key.scopes), key.id))
        scopes.append(("key", key.id, key.tenant, key.id, access.key_limits.budgets))
    used = {period: _used_in(gateway, *period_range(period, now)) for period in ("day", "month")}
    rows = []
    for scope, name, tenant, key_id, set_budgets in scopes:
        if set_budgets is None:
            continue
        for period in ("day", "month"):
            counted = used[period][("key", key_id) if key_id else ("tenant", tenant)]
            for unit in ("tokens", "requests"):
                limit = getattr(set_budgets, f"{unit}_per_{period}")
                if limit is not None:
                    rows.append({"scope": scope, "name": name, "tenant": tenant, "period": period, "unit": unit,
                                 "limit": limit, "used": counted[unit], "share": round(counted[unit] / limit, 4)})
    return {"budgets": rows}


def _used_in(gateway: GatewayState, start: datetime, end: datetime) -> dict[tuple[str, Any], dict[str, int]]:
    counted: dict[tuple[str, Any], dict[str, int]] = {}
    for item in _traffic(gateway, Filter(since=start, until=end)):
        if item.get("decision") == "denied":
            continue
        tokens = 0 if item.get("tokens_estimated") else (
            int(item.get("prompt_tokens") or 0) + int(item.get("completion_tokens") or 0))
        for scope in (("tenant", item.get("tenant")), ("key", item.get("key_id"))):
            row = counted.setdefault(scope, {"tokens": 0, "requests": 0})
            row["tokens"] += tokens
            row["requests"] += 1
    return _Zeros(counted)


class _Zeros(dict):
    def __missing__(self, key: Any) -> dict[str, int]:
        return {"tokens": 0, "requests": 0}


def keys(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """Every key of the policy in force, with its state now; the salted hash stays out too."""
    now, loaded = _now(), gateway.store.current
    last_used: dict[str, str] = {}
    for item in records(gateway.audit.path, Filter()):
        if item.get("key_id") and item.get("time"):
            last_used[item["key_id"]] = str(item["time"])  # oldest first: the last one wins
    rows = []
    for key in sorted(loaded.keys.values(), key=lambda k: k.created_at):
        access = access_for(loaded, Principal(key.principal, key.tenant, frozenset(key.scopes), key.id))
        state = ("revoked" if key.revoked_at is not None
                 else "expired" if key.expires_at is not None and key.expires_at <= now else "active")
        rows.append({"id": key.id, "principal": key.principal, "tenant": key.tenant, "scopes": key.scopes,
                     "models": key.models, "created_at": key.created_at.isoformat(),
                     "expires_at": _iso(key.expires_at), "revoked_at": _iso(key.revoked_at),
                     "replaced_by": key.replaced_by, "note": key.note, "state": state,
                     "last_used": last_used.get(key.id),
                     "limits": access.key_limits.model_dump(mode="json", exclude_none=True),
                     "tenant_limits": access.tenant_limits.model_dump(mode="json", exclude_none=True)})
    return {"keys": rows}


def policy(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """Which policy serves, since when, and the refused edit on disk (its `file:line: reason`) if any."""
    store = gateway.store
    status = store.status()
    return {"path": str(store.path), "generation": status["generation"],
            "applied_at": datetime.fromtimestamp(status["loaded_at"], timezone.utc).isoformat(),
            "reload_refused": status["reload_refused"], "refusals": status["refusals"],
            "refused_edit": str(store.last_error) if store.last_error is not None else None,
            "console_write_scope": store.current.policy.console.write_scope if store.current.policy.keys_file else None}


def fleet(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """Each engine the gateway forwards to: up or not, and the load it last reported."""
    replicas = []
    for replica in gateway.fleet.replicas.values():
        replicas.append({"name": replica.name, "url": replica.config.url, "healthy": replica.healthy,
                         "models": sorted(replica.served) if replica.served is not None else None,
                         "in_flight": replica.in_flight, "running": replica.running,
                         "waiting": replica.waiting, "kv_cache_usage": replica.kv_usage,
                         "prefix_cache_hit_rate": (replica.prefix_hits / replica.prefix_queries
                                                   if replica.prefix_queries else None),
                         "consecutive_failures": replica.failures})
    return {"replicas": replicas}


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def _now() -> datetime:
    return datetime.now(timezone.utc)


ENDPOINTS: dict[str, Callable[[GatewayState, dict[str, str]], dict[str, Any]]] = {
    "audit": audit_records, "verify": chain, "usage": usage_rows, "budgets": budgets, "keys": keys,
    "policy": policy, "fleet": fleet,
}
