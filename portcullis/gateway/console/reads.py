"""The console's reads: each endpoint a function of the gateway and the bounded query, run in
the console's thread (`common.limiter`); `export` streams its rows instead."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter, deque
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi.responses import Response, StreamingResponse

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
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.console.common import API, bad, iso, now, response_headers
from portcullis.gateway.proxy_call import ProxyCall
from portcullis.gateway.state import GatewayState

LIMIT_DEFAULT, LIMIT_MAX = 100, 1000
PROBLEMS_SHOWN = 50
TEXT_FILTERS = ("principal", "tenant", "status", "decision", "model", "reason", "route")

EXPORT_COLUMNS = ("time", "request_id", "principal", "tenant", "client", "method", "route", "model", "status",
                  "decision", "reason", "prompt_tokens", "completion_tokens", "cached_tokens", "latency_ms")
EXPORT_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}


def export(call: ProxyCall, principal: Principal, params: dict[str, str]) -> Response:
    """Every record that passes the filters, oldest first, streamed from the files as it is read
    (a large log is never held in memory); once the last row is out, an `admin_action` line
    says who exported what and how many rows."""
    record, fmt = call.record, params.get("format", "jsonl")
    if fmt not in EXPORT_TYPES:
        raise bad("format", "give jsonl or csv")
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
    name = f"portcullis-audit-{now():%Y%m%dT%H%M%SZ}.{fmt}"
    return StreamingResponse(rows(), media_type=EXPORT_TYPES[fmt], headers={
        **response_headers(record.request_id), "content-disposition": f'attachment; filename="{name}"'})


def _csv_row(values) -> bytes:
    """One CSV line; a text cell that a spreadsheet would run as a formula is quoted with '."""
    out = io.StringIO()
    csv.writer(out).writerow(["'" + v if isinstance(v, str) and v[:1] in ("=", "+", "-", "@") else
                              "" if v is None else v for v in values])
    return out.getvalue().encode()


def _filter(params: dict[str, str]) -> Filter:
    times = {}
    for name in ("since", "until"):
        if name in params:
            try:
                times[name] = parse_time(params[name])
            except ValueError:
                raise bad(name, "give an ISO 8601 time, e.g. 2026-12-06T09:00:00Z") from None
    return Filter(**times, **{name: params[name] for name in TEXT_FILTERS if params.get(name)})


def _limit(params: dict[str, str]) -> int:
    text = params.get("limit", str(LIMIT_DEFAULT))
    if not text.isdigit() or not 1 <= int(text) <= LIMIT_MAX:
        raise bad("limit", f"give a whole number from 1 to {LIMIT_MAX}")
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
            "notes": verdict.notes[:PROBLEMS_SHOWN], "checked_at": now().isoformat()}


def usage_rows(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """Chargeback rows for a UTC period (`day`, `month`, `2026-12`, `2026-12-06`; default the
    current day), grouped `by` any of tenant, principal, model (comma-separated), and the same
    per hour or day; requests for the engine only (see _traffic)."""
    period = params.get("period", "day")
    try:
        start, end = period_range(period, now())
    except ValueError as exc:
        raise bad("period", str(exc)) from None
    by = tuple(params.get("by", ",".join(USAGE_BY)).split(","))
    if not by or len(set(by)) != len(by) or not set(by) <= set(USAGE_BY):
        raise bad("by", f"give some of {', '.join(USAGE_BY)}, comma-separated")
    items = list(_traffic(gateway, Filter(since=start, until=end)))
    refusals = Counter(str(item.get("reason")) for item in items if item.get("decision") == "denied")
    return {"period": {"start": start.isoformat(), "end": end.isoformat()}, "by": list(by),
            "rows": usage(iter(items), by), "series": _series(items, start, end),
            "refusals_by_reason": dict(refusals.most_common())}


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
    """Every budget (per UTC day and month) and rate limit (per minute: the last 60 s) the
    policy sets, per tenant and per key, against the use the audit log counts (reported tokens;
    the gateway's own counters also hold reservations of requests still running)."""
    loaded, moment = gateway.store.current, now()
    scopes = [("tenant", name, name, None, rule.limits) for name, rule in loaded.policy.tenants.items()]
    for key in loaded.keys.values():
        access = access_for(loaded, Principal(key.principal, key.tenant, frozenset(key.scopes), key.id))
        scopes.append(("key", key.id, key.tenant, key.id, access.key_limits))
    used = {period: _used_in(gateway, *period_range(period, moment)) for period in ("day", "month")}
    used["minute"] = _used_in(gateway, moment - timedelta(minutes=1), moment)
    rows = []
    for scope, name, tenant, key_id, limits in scopes:
        for period, unit, limit in _limits_of(limits):
            counted = used[period][("key", key_id) if key_id else ("tenant", tenant)]
            rows.append({"scope": scope, "name": name, "tenant": tenant, "period": period, "unit": unit,
                         "limit": limit, "used": counted[unit], "share": round(counted[unit] / limit, 4)})
    return {"budgets": rows}


def _limits_of(limits: Any) -> list[tuple[str, str, int]]:
    """(period, unit, limit) of each per-minute rate and each budget a scope sets."""
    found = [("minute", unit, getattr(limits, f"{unit}_per_minute")) for unit in ("requests", "tokens")]
    if limits.budgets is not None:
        found += [(period, unit, getattr(limits.budgets, f"{unit}_per_{period}"))
                  for period in ("day", "month") for unit in ("tokens", "requests")]
    return [(period, unit, limit) for period, unit, limit in found if limit is not None]


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
    moment, loaded = now(), gateway.store.current
    last_used: dict[str, str] = {}
    for item in records(gateway.audit.path, Filter()):
        if item.get("key_id") and item.get("time"):
            last_used[item["key_id"]] = str(item["time"])  # oldest first: the last one wins
    rows = []
    for key in sorted(loaded.keys.values(), key=lambda k: k.created_at):
        access = access_for(loaded, Principal(key.principal, key.tenant, frozenset(key.scopes), key.id))
        state = ("revoked" if key.revoked_at is not None
                 else "expired" if key.expires_at is not None and key.expires_at <= moment else "active")
        rows.append({"id": key.id, "principal": key.principal, "tenant": key.tenant, "scopes": key.scopes,
                     "models": key.models, "created_at": key.created_at.isoformat(),
                     "expires_at": iso(key.expires_at), "revoked_at": iso(key.revoked_at),
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


def policy_text(gateway: GatewayState, params: dict[str, str]) -> dict[str, Any]:
    """The policy file's text as it is on disk (what an edit starts from), and the generation
    that serves: a save names it, so that two editors cannot overwrite each other unseen."""
    store = gateway.store
    return {"text": store.path.read_text(encoding="utf-8"), "generation": store.generation,
            "reload_refused": store.last_error is not None}


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


ENDPOINTS: dict[str, Callable[[GatewayState, dict[str, str]], dict[str, Any]]] = {
    "audit": audit_records, "verify": chain, "usage": usage_rows, "budgets": budgets, "keys": keys,
    "policy": policy, "policy/text": policy_text, "fleet": fleet,
}
