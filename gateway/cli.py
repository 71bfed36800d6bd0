"""The `portcullis` command line: run the gateway, manage keys, check policy, review audit.

`portcullis engine ...` is handed to the engine package's own `__main__` in a fresh
interpreter, so this package never imports the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.policy.loader import PolicyError, load_policy, resolve_relative

TOKEN_ENV = "PORTCULLIS_ENGINE_TOKEN"
DURATION = re.compile(r"^(\d+)([smhdw])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration(text: str) -> timedelta:
    match = DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 24h or 90d")
    return timedelta(seconds=int(match.group(1)) * UNITS[match.group(2)])


def fail(message: str, code: int = 1) -> int:
    print(f"portcullis: {message}", file=sys.stderr)
    return code


# ---- gateway -------------------------------------------------------------------------

def _engine_token(args: argparse.Namespace) -> str | None:
    if args.engine_token_file:
        return Path(args.engine_token_file).read_text().strip()
    return os.environ.get(TOKEN_ENV)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.settings import GatewaySettings

    token = _engine_token(args)
    if not token:
        return fail(f"no engine token: pass --engine-token-file or set {TOKEN_ENV}", 2)
    try:
        settings = GatewaySettings(host=args.host, port=args.port, policy=Path(args.policy),
                                   engine_url=args.engine_url, engine_token=token, workers=args.workers,
                                   forwarded_allow_ips=args.forwarded_allow_ips)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return fail(f"refusing to start: {problems}", 2)
    try:
        loaded = load_policy(settings.policy)
    except PolicyError as exc:
        return fail(f"refusing to start: {exc}", 2)
    if settings.workers > 1 and loaded.policy.rate_limits.storage.startswith("memory://"):
        print(f"portcullis: warning: rate limits are kept per worker with memory:// storage, so each of "
              f"the {settings.workers} workers allows the full limit; set rate_limits.storage to a "
              "redis:// URL to share them", file=sys.stderr)
    _serve(settings, token)
    return 0


def _serve(settings: Any, token: str) -> None:
    import uvicorn

    from gateway.app import SETTINGS_ENV, create_app
    from gateway.oplog import configure_logging

    configure_logging(force=True)
    proxied = settings.forwarded_allow_ips is not None
    common = dict(host=settings.host, port=settings.port, log_level="warning", access_log=False,
                  server_header=False, proxy_headers=proxied, timeout_graceful_shutdown=30)
    if proxied:
        common["forwarded_allow_ips"] = settings.forwarded_allow_ips
    if settings.workers == 1:
        uvicorn.run(create_app(settings), **common)
        return
    # Worker processes rebuild the app from the environment (uvicorn needs an import string).
    os.environ[SETTINGS_ENV] = settings.model_dump_json(exclude={"engine_token"})
    os.environ[TOKEN_ENV] = token
    config = uvicorn.Config("gateway.app:create_app_from_env", factory=True, workers=settings.workers, **common)
    _run_workers(config)


def _run_workers(config: Any) -> None:
    """uvicorn's multi-worker mode, with TCP_NODELAY on the shared listening socket.

    uvicorn binds that socket itself with protocol 0, so asyncio never turns Nagle off on the
    connections it accepts: a response written as head then body then waits for the
    client's delayed ACK, adding about 40 ms to every keep-alive request. Linux copies
    TCP_NODELAY from a listening socket to each accepted one, so setting it once fixes all.
    """
    import inspect
    import socket

    import uvicorn
    from uvicorn.supervisors import Multiprocess

    sock = config.bind_socket()
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if "target" in inspect.signature(Multiprocess).parameters:  # uvicorn < 0.30
        Multiprocess(config, target=uvicorn.Server(config).run, sockets=[sock]).run()
    else:
        Multiprocess(config, sockets=[sock]).run()


# ---- keys ----------------------------------------------------------------------------

def _keys_path(args: argparse.Namespace) -> tuple[Path, Any]:
    if args.keys_file:
        return Path(args.keys_file), None
    loaded = load_policy(args.policy)
    if not loaded.policy.keys_file:
        raise PolicyError(args.policy, None, "the policy names no keys_file; add one or pass --keys-file")
    return resolve_relative(loaded.path, loaded.policy.keys_file), loaded


def cmd_keys(args: argparse.Namespace) -> int:
    from gateway.keys import KeyBook

    try:
        path, loaded = _keys_path(args)
        book = KeyBook(path)
        return KEY_ACTIONS[args.keys_cmd](args, book, loaded)
    except (PolicyError, KeyError, ValueError) as exc:
        return fail(str(exc).strip("'\""))


def _keys_create(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    from gateway.keys import new_key, utcnow

    if loaded is not None and args.tenant not in loaded.policy.tenants:
        return fail(f"tenant {args.tenant!r} is not in the policy ({', '.join(loaded.policy.tenants)})")
    expires = utcnow() + args.expires_in if args.expires_in else None
    token, record = new_key(args.principal, args.tenant, args.scope or [], expires, args.note or "", args.model)
    book.add(record)
    print(f"Created key {record.id} for {record.principal} (tenant {record.tenant}).", file=sys.stderr)
    print("It is shown only this once; only its hash is stored:", file=sys.stderr)
    print(token)
    return 0


def _keys_list(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    from gateway.keys import key_state, utcnow

    now = utcnow()
    rows = [{"id": r.id, "principal": r.principal, "tenant": r.tenant, "scopes": ",".join(r.scopes),
             "models": ",".join(r.models) if r.models is not None else "*",
             "state": key_state(r, now), "created": r.created_at.isoformat(),
             "expires": r.expires_at.isoformat() if r.expires_at else "-", "note": r.note}
            for r in book.keys.keys]
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0


def _keys_revoke(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    record = book.revoke(args.key_id)
    print(f"Revoked key {record.id} ({record.principal}); the gateway applies it within 2 s.")
    return 0


def _keys_rotate(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    token, new, old = book.rotate(args.key_id, args.overlap)
    print(f"New key {new.id} for {new.principal}; old key {old.id} works until "
          f"{old.expires_at.isoformat()}. Shown only this once:", file=sys.stderr)
    print(token)
    return 0


KEY_ACTIONS = {"create": _keys_create, "list": _keys_list, "revoke": _keys_revoke, "rotate": _keys_rotate}


# ---- policy --------------------------------------------------------------------------

def cmd_policy(args: argparse.Namespace) -> int:
    if args.policy_cmd == "schema":
        from gateway.policy.schema import policy_schema

        print(json.dumps(policy_schema(), indent=2))
        return 0
    try:
        loaded = load_policy(args.file)
    except PolicyError as exc:
        print(f"INVALID {exc}")
        return 1
    print(_explain(loaded))
    return 0


def _explain(loaded: Any) -> str:
    p = loaded.policy
    lines = [f"OK {loaded.path}", f"  routes ({len(p.routes)}):"]
    lines += [f"    {r.method:6} {r.path}" + (f"  [scopes: {', '.join(r.scopes)}]" if r.scopes else "")
              for r in p.routes]
    lines.append(f"  tenants ({len(p.tenants)}):")
    for name, t in p.tenants.items():
        limits = t.limits.model_dump(exclude_none=True)
        lines.append(f"    {name}: models {', '.join(t.models)}; tenant limits {limits or 'none'}; "
                     f"cache {t.cache_scope or p.cache_scope}")
    lines.append(f"  principals with rules: {len(p.principals)}; keys: {len(loaded.keys)}")
    lines.append(f"  jwt: {', '.join(p.jwt.algorithms) + ' from ' + p.jwt.issuer if p.jwt else 'off'}")
    lines.append(f"  rate-limit storage: {p.rate_limits.storage.split('@')[-1]}; audit: {p.audit.path}"
                 f" (prompts {'logged' if p.audit.log_prompts else 'hashed'})")
    return "\n".join(lines)


# ---- audit ---------------------------------------------------------------------------

def _audit_path(args: argparse.Namespace) -> Path:
    if args.file:
        return Path(args.file)
    if args.policy:
        loaded = load_policy(args.policy)
        return resolve_relative(loaded.path, loaded.policy.audit.path)
    return Path("audit.log")


def cmd_audit(args: argparse.Namespace) -> int:
    from gateway.audit import review

    try:
        path = _audit_path(args)
    except PolicyError as exc:
        return fail(str(exc))
    if not review.log_files(path):
        return fail(f"no audit log at {path}")
    if args.audit_cmd == "verify":
        return _verify(review.verify(path), args.json)
    flt = review.Filter(since=args.since, until=args.until, principal=args.principal, tenant=args.tenant,
                        status=args.status, decision=args.decision, model=args.model, reason=args.reason)
    found = review.records(path, flt)
    if args.summary:
        summary = review.summarise(found)
        print(json.dumps(summary, indent=2) if args.json else _summary_tables(summary))
    elif args.json:
        for record in found:
            print(json.dumps(record))
    else:
        print(_table([{k: r.get(k) for k in AUDIT_COLUMNS} for r in found]))
    return 0


AUDIT_COLUMNS = ("time", "request_id", "principal", "tenant", "method", "route", "model", "status",
                 "decision", "reason", "prompt_tokens", "completion_tokens", "latency_ms")


def _verify(verdict: Any, as_json: bool) -> int:
    if as_json:
        print(json.dumps(verdict.__dict__, indent=2))
    else:
        for note in verdict.notes:
            print(f"note: {note}")
        for problem in verdict.problems:
            print(f"TAMPERED {problem}")
        state = "OK" if verdict.ok else "FAILED"
        print(f"{state}: {verdict.lines} records; head {verdict.head}")
    return 0 if verdict.ok else 1


def _summary_tables(summary: dict[str, Any]) -> str:
    parts = []
    for title in ("by_principal", "by_tenant"):
        rows = [{"name": name, **row} for name, row in summary[title].items()]
        parts.append(f"{title.replace('_', ' ')}:\n{_table(rows)}")
    rows = [{"reason": k, "count": v} for k, v in summary["denials_by_reason"].items()]
    parts.append(f"denials by reason:\n{_table(rows)}")
    return "\n\n".join(parts)


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    columns = list(rows[0])
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*columns)] + [fmt.format(*row) for row in cells])


# ---- parser --------------------------------------------------------------------------

def _time(text: str) -> Any:
    from gateway.audit.review import parse_time

    try:
        return parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO time like 2026-01-31T12:00Z") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="portcullis", description="Portcullis: LLM serving behind a secure gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    _gateway_parser(sub)
    _keys_parser(sub)
    _policy_parser(sub)
    _audit_parser(sub)
    sub.add_parser("engine", help="run the inference engine alone (arguments go to `python -m engine`)")
    sub.add_parser("serve", help="engine + gateway in one command (`portcullis serve --help`)")
    return parser


def _gateway_parser(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run the gateway in front of an engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", required=True, help="policy YAML (hot-reloaded)")
    p.add_argument("--engine-url", default="unix:///run/portcullis/engine.sock",
                   help="unix:///path/to/sock or http://host:port (private network only)")
    p.add_argument("--engine-token-file", help=f"file with the internal token (else env {TOKEN_ENV})")
    p.add_argument("--workers", type=int, default=1, help="worker processes (share limits via Redis)")
    p.add_argument("--forwarded-allow-ips", help="comma-separated addresses of trusted reverse proxies; "
                   "only their X-Forwarded-For sets the client address (default: trust none)")
    p.set_defaults(func=cmd_gateway)


def _keys_parser(sub: Any) -> None:
    p = sub.add_parser("keys", help="create, list, revoke and rotate API keys")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--policy", help="policy whose keys_file to manage")
    where.add_argument("--keys-file", help="keys file to manage directly")
    ks = p.add_subparsers(dest="keys_cmd", required=True)
    create = ks.add_parser("create", help="make a key; prints it once")
    create.add_argument("--principal", required=True)
    create.add_argument("--tenant", required=True)
    create.add_argument("--scope", action="append", help="repeatable")
    create.add_argument("--model", action="append", help="repeatable; limit this key to these models")
    create.add_argument("--expires-in", type=duration, help="e.g. 90d")
    create.add_argument("--note")
    listing = ks.add_parser("list", help="list keys (never secrets)")
    listing.add_argument("--json", action="store_true")
    ks.add_parser("revoke", help="revoke a key now").add_argument("key_id")
    rotate = ks.add_parser("rotate", help="new key; the old one works for --overlap")
    rotate.add_argument("key_id")
    rotate.add_argument("--overlap", type=duration, default=timedelta(hours=24))
    p.set_defaults(func=cmd_keys)


def _policy_parser(sub: Any) -> None:
    p = sub.add_parser("policy", help="validate a policy or print its JSON Schema")
    ps = p.add_subparsers(dest="policy_cmd", required=True)
    ps.add_parser("check", help="validate and explain; exit 0 valid, 1 invalid").add_argument("file")
    ps.add_parser("schema", help="print the policy JSON Schema")
    p.set_defaults(func=cmd_policy)


def _audit_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="filter and summarise the audit log; `audit verify` checks the chain")
    p.add_argument("--file", help="audit log (default: from --policy, else ./audit.log)")
    p.add_argument("--policy", help="policy whose audit.path to read")
    p.add_argument("--json", action="store_true")
    p.add_argument("--summary", action="store_true", help="requests/tokens per principal and tenant, denials")
    p.add_argument("--since", type=_time)
    p.add_argument("--until", type=_time)
    for name in ("principal", "tenant", "decision", "model", "reason"):
        p.add_argument(f"--{name}")
    p.add_argument("--status", help="e.g. 429 or 4xx")
    av = p.add_subparsers(dest="audit_cmd")
    verify = av.add_parser("verify", help="check the hash chain; exit 1 if a line was edited, removed or moved")
    # SUPPRESS keeps a value given before `verify` from being reset by the sub-parser's default.
    verify.add_argument("--file", default=argparse.SUPPRESS)
    verify.add_argument("--policy", default=argparse.SUPPRESS)
    verify.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    p.set_defaults(func=cmd_audit)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "engine":
        os.execv(sys.executable, [sys.executable, "-m", "engine", *argv[1:]])
        return 0  # not reached: execv replaces this process
    if argv and argv[0] == "serve":
        from gateway.serve import main as serve

        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
