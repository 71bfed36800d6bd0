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

from gateway.policy.loader import PolicyError, key_problem, load_policy, resolve_relative
from gateway.policy.models import ID_PATTERN
from gateway.telemetry import add_tracing_flag
from gateway.tls import add_tls_flags, tls_problem, uvicorn_tls_options

TLS_FIELDS = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs")

TOKEN_ENV = "PORTCULLIS_ENGINE_TOKEN"
DURATION = re.compile(r"^(\d+)([smhdw])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_DURATION_S = 100 * 365 * 86400


def duration(text: str) -> timedelta:
    match = DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 24h, 90d or 2w")
    seconds = int(match.group(1)) * UNITS[match.group(2)]
    if seconds > MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 100 years; leave the option out for no expiry")
    return timedelta(seconds=seconds)


def positive_duration(text: str) -> timedelta:
    span = duration(text)
    if not span:
        raise argparse.ArgumentTypeError(f"{text!r} would expire at once; give a positive duration such as 90d")
    return span


def name(text: str) -> str:
    if not re.match(ID_PATTERN, text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid name: use letters, digits and _ . : @ - "
                                         "(starting with a letter or digit, at most 128 characters)")
    return text


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
                                   forwarded_allow_ips=args.forwarded_allow_ips,
                                   audit_keyring=Path(args.audit_keyring) if args.audit_keyring else None,
                                   **{field: getattr(args, field) for field in CONNECTION_FLAGS},
                                   **{field: getattr(args, field) for field in TLS_FIELDS},
                                   otlp_traces_endpoint=args.otlp_traces_endpoint, audit_syslog=args.audit_syslog)
    except ValidationError as exc:
        problems = "; ".join(f"{_setting_name(e['loc'])}: {e['msg']}" for e in exc.errors())
        return fail(f"refusing to start: {problems}", 2)
    try:
        loaded = load_policy(settings.policy)
    except PolicyError as exc:
        return fail(f"refusing to start: {exc}", 2)
    problem = _audit_keyring_problem(settings, loaded) or tls_problem(settings)
    if settings.otlp_traces_endpoint and not problem:
        from gateway.telemetry import tracing_problem

        problem = tracing_problem()
    if problem:
        return fail(f"refusing to start: {problem}", 2)
    if settings.workers > 1 and loaded.policy.rate_limits.storage.startswith("memory://"):
        print(f"portcullis: warning: rate limits are kept per worker with memory:// storage, so each of "
              f"the {settings.workers} workers allows the full limit; set rate_limits.storage to a "
              "redis:// URL to share them", file=sys.stderr)
    _serve(settings, token)
    return 0


def _audit_keyring_problem(settings: Any, loaded: Any) -> str | None:
    """Load (or on first start create) the audit keyring before any worker starts, so every
    worker finds it, and a keyring the gateway cannot use stops it here with a clear message."""
    from gateway.audit.keys import AuditKeyring, KeyringError, check_outside, keyring_path

    path = keyring_path(settings.audit_keyring, settings.policy)
    try:
        AuditKeyring.load_or_create(path)
        check_outside(path, resolve_relative(loaded.path, loaded.policy.audit.path))
    except KeyringError as exc:
        return str(exc)
    except OSError as exc:
        return (f"cannot create the audit keyring {path} ({exc.strerror}); create it where it can be "
                "written (`portcullis audit init-keyring FILE`), mount it read-only and pass --audit-keyring")
    return None


def _setting_name(loc: tuple[Any, ...]) -> str:
    """The flag that sets a settings field, so the message says what to change."""
    name = ".".join(map(str, loc))
    if name in CONNECTION_FLAGS:
        return CONNECTION_FLAGS[name][0]
    return "--engine-token-file" if name == "engine_token" else "--" + name.replace("_", "-")


def _serve(settings: Any, token: str) -> None:
    import uvicorn

    from gateway.app import SETTINGS_ENV, create_app
    from gateway.metrics import metrics_shared_by_workers
    from gateway.oplog import configure_logging

    configure_logging(force=True)
    proxied = settings.forwarded_allow_ips is not None
    common = dict(host=settings.host, port=settings.port, log_level="warning", access_log=False,
                  server_header=False, proxy_headers=proxied, timeout_graceful_shutdown=30,
                  **_connection_options(settings), **uvicorn_tls_options(settings))
    if proxied:
        common["forwarded_allow_ips"] = settings.forwarded_allow_ips
    if settings.workers == 1:
        uvicorn.run(create_app(settings), **common)
        return
    # Worker processes rebuild the app from the environment (uvicorn needs an import string).
    os.environ[SETTINGS_ENV] = settings.model_dump_json(exclude={"engine_token"})
    os.environ[TOKEN_ENV] = token
    config = uvicorn.Config("gateway.app:create_app_from_env", factory=True, workers=settings.workers, **common)
    with metrics_shared_by_workers():
        _run_workers(config)


def _connection_options(settings: Any) -> dict[str, Any]:
    """h11 (httptools buffers a request head of any size) with the limits of gateway/connection.py.

    A partial, not a closure: worker processes receive the config pickled.
    """
    from functools import partial

    from gateway.connection import ConnectionLimits, GuardedH11Protocol

    limits = ConnectionLimits(settings.timeout_header_s, settings.timeout_body_s, settings.timeout_send_s,
                              settings.limit_concurrency, settings.h11_max_incomplete_event_size)
    return dict(http=partial(GuardedH11Protocol, limits=limits), timeout_keep_alive=settings.timeout_keep_alive_s,
                h11_max_incomplete_event_size=settings.h11_max_incomplete_event_size)


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
        raise PolicyError(args.policy, None, "the policy names no keys_file; add `keys_file: keys.yaml` to it "
                          "or pass --keys-file")
    return resolve_relative(loaded.path, loaded.policy.keys_file), loaded


def cmd_keys(args: argparse.Namespace) -> int:
    from gateway.auth.keys import KeyBook

    args.policy, args.keys_file = getattr(args, "policy", None), getattr(args, "keys_file", None)
    if bool(args.policy) == bool(args.keys_file):
        return fail("say which keys to manage: --policy POLICY.yaml (its keys_file) or --keys-file FILE", 2)
    try:
        path, loaded = _keys_path(args)
        book = KeyBook(path)
        return KEY_ACTIONS[args.keys_cmd](args, book, loaded)
    except PolicyError as exc:
        hint = "" if args.keys_file else "; fix it, or pass --keys-file to manage the keys file alone"
        return fail(f"{exc}{hint}")
    except (KeyError, ValueError) as exc:
        return fail(str(exc.args[0]) if exc.args else str(exc))


def _keys_create(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    from gateway.auth.keys import new_key, utcnow

    expires = utcnow() + args.expires_in if args.expires_in is not None else None
    token, record = new_key(args.principal, args.tenant, args.scope or [], expires, args.note or "", args.model)
    if loaded is not None:
        # Refuse here what the gateway would refuse on reload: one bad record would freeze every
        # later key change (revocations included) until someone edits the file by hand.
        problem = key_problem(loaded.policy, loaded.keys, record)
        if problem:
            return fail(problem.replace(f"key {record.id!r}", "the new key", 1) + "; no key was created")
    book.add(record)
    _audit_admin(loaded, "key_created", principal=record.principal, tenant=record.tenant, key_id=record.id,
                 scopes=list(record.scopes), expires=record.expires_at.isoformat() if record.expires_at else None)
    print(f"Created key {record.id} for {record.principal} (tenant {record.tenant}"
          f"{', expires ' + _when(record.expires_at) if record.expires_at else ', never expires'}).", file=sys.stderr)
    print("It is shown only this once; only its hash is stored:", file=sys.stderr)
    print(token)
    return 0


def _when(moment: Any) -> str:
    return moment.strftime("%Y-%m-%d %H:%MZ") if moment else "-"


def _state_text(record: Any, now: Any) -> str:
    from gateway.auth.keys import key_state

    state = key_state(record, now)
    if state == "revoked":
        return f"revoked {_when(record.revoked_at)}"
    if state == "expired":
        return f"expired {_when(record.expires_at)}"
    if record.replaced_by:
        return f"rotating to {record.replaced_by}, works until {_when(record.expires_at)}"
    if record.revoked_at is not None:
        return f"active, revoked from {_when(record.revoked_at)}"
    return "active"


def _keys_list(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    from gateway.auth.keys import key_state, utcnow

    now = utcnow()
    if args.json:
        rows = [{"id": r.id, "principal": r.principal, "tenant": r.tenant, "scopes": list(r.scopes),
                 "models": list(r.models) if r.models is not None else None, "state": key_state(r, now),
                 "created": r.created_at.isoformat(), "expires": r.expires_at.isoformat() if r.expires_at else None,
                 "revoked": r.revoked_at.isoformat() if r.revoked_at else None, "replaced_by": r.replaced_by,
                 "note": r.note} for r in book.keys.keys]
        print(json.dumps(rows, indent=2))
        return 0
    rows = [{"id": r.id, "principal": r.principal, "tenant": r.tenant, "scopes": ",".join(r.scopes) or "-",
             "models": ",".join(r.models) if r.models is not None else "*", "created": _when(r.created_at),
             "expires": _when(r.expires_at) if r.expires_at else "never", "state": _state_text(r, now),
             "note": r.note} for r in book.keys.keys]
    print(_table(rows) if rows else f"no keys in {book.path}")
    return 0


def _keys_revoke(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    record, revoked = book.revoke(args.key_id)
    if not revoked:  # idempotent, so a script revoking a list never stops halfway
        print(f"Key {record.id} ({record.principal}) was already revoked at {_when(record.revoked_at)}; nothing changed.")
        return 0
    _audit_admin(loaded, "key_revoked", principal=record.principal, tenant=record.tenant, key_id=record.id)
    print(f"Revoked key {record.id} ({record.principal}); a running gateway refuses it within 2 s.")
    return 0


def _keys_rotate(args: argparse.Namespace, book: Any, loaded: Any) -> int:
    token, new, old = book.rotate(args.key_id, args.overlap)
    _audit_admin(loaded, "key_rotated", principal=new.principal, tenant=new.tenant, key_id=new.id,
                 replaces=old.id, old_key_until=old.expires_at.isoformat() if old.expires_at else None)
    print(f"New key {new.id} for {new.principal}; the old key {old.id} works until "
          f"{_when(old.expires_at)}, then stops. The new key is shown only this once:", file=sys.stderr)
    print(token)
    return 0


def _audit_admin(loaded: Any, action: str, **fields: Any) -> None:
    """One `admin_action` line in the policy's audit log, chained and keyed like the gateway's
    own (never a secret: ids, principal, tenant). Without --policy there is no log to write to."""
    import getpass

    from gateway.audit.keys import AuditKeyring, KeyringError, check_outside, keyring_path
    from gateway.audit.log import ChainedFile, utc_stamp

    if loaded is None:
        print("portcullis: note: with --keys-file alone this command writes no audit line; a gateway using "
              "the file audits the change when it reloads (policy_reload names the keys)", file=sys.stderr)
        return
    audit = loaded.policy.audit
    path = resolve_relative(loaded.path, audit.path)
    try:
        keyring = AuditKeyring.load_or_create(keyring_path(None, loaded.path))
        check_outside(keyring.path, path)
        log = ChainedFile(path, audit.max_bytes, audit.backups, keyring)
        try:
            log.msg(time=utc_stamp(), event="admin_action", action=action, actor=getpass.getuser(),
                    via="portcullis keys", **fields)
        finally:
            log.close()
    except (KeyringError, OSError) as exc:
        print(f"portcullis: warning: the change is made, but it could not be written to the audit log: {exc}",
              file=sys.stderr)


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
                     f"cache {t.cache_scope or p.cache_scope}"
                     + (f"; priority {t.priority}" if t.priority is not None else ""))
    lines.append(f"  principals with rules: {len(p.principals)}; keys: {len(loaded.keys)}")
    lines.append(f"  jwt: {', '.join(p.jwt.algorithms) + ' from ' + p.jwt.issuer if p.jwt else 'off'}")
    lines.append(f"  rate-limit storage: {p.rate_limits.storage.split('@')[-1]}; audit: {p.audit.path}"
                 f" (prompts {'logged' if p.audit.log_prompts else 'hashed'})")
    lines += [f"  warning: {w}" for w in _warnings(loaded)]
    return "\n".join(lines)


def _warnings(loaded: Any) -> list[str]:
    """Valid, but probably not what the admin meant: files the policy names that are not there."""
    p, found = loaded.policy, []
    if p.keys_file and not resolve_relative(loaded.path, p.keys_file).exists():
        found.append(f"keys_file {p.keys_file} does not exist yet, so no API key works; "
                     f"make one with `portcullis keys --policy {loaded.path} create ...`")
    if p.jwt and p.jwt.jwks_file and not resolve_relative(loaded.path, p.jwt.jwks_file).exists():
        found.append(f"jwt.jwks_file {p.jwt.jwks_file} does not exist, so every RS256/ES256 JWT is refused")
    if p.jwt and p.jwt.hs256_secret_env and not os.environ.get(p.jwt.hs256_secret_env):
        found.append(f"${p.jwt.hs256_secret_env} (jwt.hs256_secret_env) is not set here; the gateway "
                     "refuses HS256 JWTs unless it is set in the gateway's environment")
    prioritised = [f"tenants.{name}" for name, t in p.tenants.items() if t.priority] + [
        f"principals.{name}" for name, rule in p.principals.items() if rule.priority]
    if prioritised:
        found.append(f"{', '.join(prioritised)} set a priority: start the engine with --scheduling-policy "
                     "priority, or it refuses every request with a priority other than 0 (400)")
    from gateway.policy.models import memory_budgets_warning

    found += [w for w in [memory_budgets_warning(p)] if w]
    return found


# ---- audit ---------------------------------------------------------------------------

def _audit_path(args: argparse.Namespace) -> Path:
    if args.file:
        return Path(args.file)
    if args.policy:
        loaded = load_policy(args.policy)
        return resolve_relative(loaded.path, loaded.policy.audit.path)
    return Path("audit.log")


def _keyring_file(args: argparse.Namespace) -> Path | None:
    """--keyring, else the default for --policy (or $PORTCULLIS_AUDIT_KEYRING) if it exists."""
    from gateway.audit.keys import KEYRING_ENV, keyring_path

    if args.keyring:
        return Path(args.keyring)
    if args.policy:
        found = keyring_path(None, Path(args.policy))
    elif os.environ.get(KEYRING_ENV):
        found = Path(os.environ[KEYRING_ENV])
    else:
        return None
    return found if found.exists() else None


def cmd_audit(args: argparse.Namespace) -> int:
    from gateway.audit import review
    from gateway.audit.keys import AuditKeyring, KeyringError

    if args.audit_cmd == "rotate-key":
        return _rotate_audit_key(args)
    if args.audit_cmd == "init-keyring":
        return _init_keyring(Path(args.target))
    try:
        path = _audit_path(args)
        keyring_file = _keyring_file(args)
        keyring = AuditKeyring.load(keyring_file) if keyring_file else None
    except (PolicyError, KeyringError) as exc:
        return fail(str(exc))
    if not review.log_files(path):
        source = "the policy's audit.path" if args.policy and not args.file else "give --file or --policy"
        return fail(f"no audit log at {path} ({source})")
    if args.audit_cmd == "verify":
        return _verify(review.verify(path, args.head, keyring), args.json)
    if args.audit_cmd == "usage":
        return _usage(path, args)
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
        rows = [{k: r.get(k) for k in AUDIT_COLUMNS} | {"route": r.get("route") or r.get("path")} for r in found]
        print(_table(rows) if rows else "no matching records")
    return 0


def _init_keyring(path: Path) -> int:
    from gateway.audit.keys import AuditKeyring

    if path.exists():
        return fail(f"{path} exists; `portcullis audit rotate-key --keyring {path}` adds keys to it", 2)
    try:
        AuditKeyring.load_or_create(path)
    except OSError as exc:
        return fail(f"cannot write {path}: {exc.strerror}")
    print(f"Wrote a new audit keyring to {path} (mode 0600). Keep it outside the audit log's folder, "
          "e.g. as a mounted secret, and give it to the gateway with --audit-keyring.")
    return 0


def _rotate_audit_key(args: argparse.Namespace) -> int:
    from gateway.audit.keys import AuditKeyring, KeyringError

    path = _keyring_file(args)
    if path is None:
        return fail("no audit keyring found: give --keyring FILE or --policy POLICY.yaml", 2)
    try:
        keyring = AuditKeyring.load(path)
        chain, signing = keyring.rotate()
    except (KeyringError, OSError) as exc:
        return fail(str(exc))
    print(f"New audit keys {chain.id} (MACs) and {signing.id} (checkpoints) in {path}; running gateways "
          "use them within a second. Older keys stay there so older lines keep verifying.")
    return 0


def _usage(path: Path, args: argparse.Namespace) -> int:
    """`audit usage`: requests and tokens per tenant, principal and model, for chargeback."""
    from gateway.audit import review
    from gateway.auth.keys import utcnow

    since, until = args.since, args.until
    if args.period:
        if since or until:
            return fail("give --period or --since/--until, not both", 2)
        try:
            since, until = review.period_range(args.period, utcnow())
        except ValueError as exc:
            return fail(str(exc), 2)
    by = tuple(name.strip() for name in args.by.split(","))
    if not by or any(name not in review.USAGE_BY for name in by):
        return fail(f"--by takes a comma-separated list of {', '.join(review.USAGE_BY)}", 2)
    flt = review.Filter(since=since, until=until, principal=args.principal, tenant=args.tenant, model=args.model)
    rows = review.usage(review.records(path, flt), by)
    span = {"since": since.isoformat() if since else None, "until": until.isoformat() if until else None}
    if args.json:
        print(json.dumps({**span, "by": list(by), "rows": rows}, indent=2))
    else:
        print(f"usage from {span['since'] or 'the start of the log'} until {span['until'] or 'now'}")
        print(_table(rows) if rows else "no matching records")
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
        where = f"; first bad line {verdict.first_bad}" if verdict.first_bad else ""
        print(f"{state}: {verdict.lines} records ({verdict.keyed} keyed, {verdict.checkpoints} signed "
              f"checkpoints){where}; head {verdict.head}")
    return 0 if verdict.ok else 1


def _summary_tables(summary: dict[str, Any]) -> str:
    parts = []
    for title in ("by_principal", "by_tenant"):
        rows = [{"name": name, **row} for name, row in summary[title].items()]
        parts.append(f"{title.replace('_', ' ')}:\n{_table(rows)}")
    rows = [{"reason": k, "count": v} for k, v in summary["denials_by_reason"].items()]
    parts.append(f"denials by reason:\n{_table(rows)}")
    rows = [{"status": k, "count": v} for k, v in summary["by_status"].items()]
    parts.append(f"by status:\n{_table(rows)}")
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
    """An ISO time, or a duration back from now (`24h` = the last 24 hours)."""
    from gateway.audit.review import parse_time
    from gateway.auth.keys import utcnow

    if DURATION.match(text.strip()):
        return utcnow() - duration(text)
    try:
        return parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO time like 2026-01-31T12:00Z "
                                         "or a duration back from now like 24h or 7d") from None


def _status(text: str) -> str:
    if not re.fullmatch(r"[1-5](\d\d|xx)", text.lower()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a status like 429 or a class like 4xx")
    return text.lower()


MAIN_EPILOG = """\
first steps:
  portcullis serve                                   engine + gateway; writes a starter policy and key
  portcullis policy check policy.yaml                validate an edit before (or after) saving it
  portcullis keys --policy policy.yaml create --principal alice --tenant default
  portcullis audit --policy policy.yaml --since 24h  who did what; `audit verify` checks the chain

`portcullis COMMAND --help` says more; policies/README.md documents the policy file.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="portcullis", description="Portcullis: LLM serving behind a secure gateway.",
                                     epilog=MAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _gateway_parser(sub)
    _keys_parser(sub)
    _policy_parser(sub)
    _audit_parser(sub)
    sub.add_parser("engine", help="run the inference engine alone (arguments go to `python -m engine`)")
    sub.add_parser("serve", help="engine + gateway in one command (`portcullis serve --help`)")
    sub.add_parser("bench", help="benchmark a running server, like `vllm bench serve` (`portcullis bench serve --help`)")
    return parser


def _gateway_parser(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run the gateway in front of an engine")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--policy", required=True, help="policy YAML (edits apply within 2 s; check them first "
                   "with `portcullis policy check`)")
    p.add_argument("--engine-url", default="unix:///run/portcullis/engine.sock",
                   help="unix:///path/to/sock or http://host:port (private network only)")
    p.add_argument("--engine-token-file", help=f"file with the internal token (else env {TOKEN_ENV})")
    p.add_argument("--workers", type=int, default=1, help="worker processes (share limits via Redis)")
    p.add_argument("--forwarded-allow-ips", help="comma-separated addresses of trusted reverse proxies; "
                   "only their X-Forwarded-For sets the client address (default: trust none)")
    p.add_argument("--audit-keyring", help="the audit keyring (HMAC and signing keys), outside the audit log's "
                   "folder; created on first start (default: $PORTCULLIS_AUDIT_KEYRING, else "
                   "secrets/audit-keyring.json beside the policy)")
    _connection_flags(p)
    add_tls_flags(p)
    add_tracing_flag(p)
    p.add_argument("--audit-syslog", metavar="URL", help="also send every audit line to syslog (RFC 5424, facility "
                   "log audit): udp://host:514 or unix:///dev/log")
    p.set_defaults(func=cmd_gateway)


# Settings field -> (flag, type, help); uvicorn's flag names where uvicorn has the setting.
CONNECTION_FLAGS = {
    "timeout_header_s": ("--timeout-header", float, "seconds a client has to send a request head"),
    "timeout_body_s": ("--timeout-body", float, "seconds a client has to send a request body after its head"),
    "timeout_send_s": ("--timeout-send", float, "seconds a response may wait for a client that stopped reading"),
    "timeout_keep_alive_s": ("--timeout-keep-alive", float, "seconds an idle connection stays open"),
    "limit_concurrency": ("--limit-concurrency", int, "connections or requests at once; more get 503"),
    "h11_max_incomplete_event_size": ("--h11-max-incomplete-event-size", int,
                                      "largest request head in bytes; larger ones get 431"),
}


def _connection_flags(parser: argparse.ArgumentParser) -> None:
    from gateway.settings import GatewaySettings

    for field, (flag, kind, text) in CONNECTION_FLAGS.items():
        default = GatewaySettings.model_fields[field].default
        metavar = {"--limit-concurrency": "N", "--h11-max-incomplete-event-size": "BYTES"}.get(flag, "SECONDS")
        parser.add_argument(flag, dest=field, type=kind, default=default, metavar=metavar,
                            help=f"{text} (default {default:g})")


KEYS_EPILOG = """\
examples:
  portcullis keys --policy policy.yaml create --principal alice --tenant research --expires-in 90d
  portcullis keys --policy policy.yaml list
  portcullis keys --policy policy.yaml rotate KEY_ID --overlap 24h
  portcullis keys --policy policy.yaml revoke KEY_ID

Keys are written to the file the policy's keys_file names (never to the policy itself), as
salted hashes only. A running gateway applies every change within 2 s.
"""


def _keys_parser(sub: Any) -> None:
    p = sub.add_parser("keys", help="create, list, revoke and rotate API keys", epilog=KEYS_EPILOG,
                       description="Manage API keys.", formatter_class=argparse.RawDescriptionHelpFormatter)
    _keys_where(p, argparse.SUPPRESS)
    ks = p.add_subparsers(dest="keys_cmd", required=True, metavar="{create,list,rotate,revoke}")
    create = ks.add_parser("create", help="make a key; prints it once",
                           description="Make a key and print it once (stdout); only its hash is stored.")
    create.add_argument("--principal", required=True, type=name,
                        help="who uses the key (the audit log's principal; rules under principals: apply)")
    create.add_argument("--tenant", required=True, type=name, help="a tenant defined in the policy")
    create.add_argument("--scope", action="append", help="repeatable, e.g. --scope admin for routes that need it")
    create.add_argument("--model", action="append", help="repeatable; limit this key to these models")
    create.add_argument("--expires-in", type=positive_duration, metavar="DURATION",
                        help="30m, 24h, 90d or 2w from now (default: never expires)")
    create.add_argument("--note", help="free text shown by `keys list`, e.g. whose laptop")
    listing = ks.add_parser("list", help="list keys and their state (never secrets)",
                            description="List keys: state (active, expired, revoked, rotating), expiry, scopes.")
    listing.add_argument("--json", action="store_true", help="machine-readable, ISO times")
    rotate = ks.add_parser("rotate", help="new key for the same principal; the old one works for --overlap",
                           description="Make a new key with the same principal, tenant, scopes and expiry, and "
                           "print it once; the old key keeps working for --overlap, then stops.")
    rotate.add_argument("key_id", help="the id shown by `keys list` (the part after ptc_, before the dot)")
    rotate.add_argument("--overlap", type=duration, default=timedelta(hours=24), metavar="DURATION",
                        help="how long the old key keeps working: 0s, 30m, 24h, 7d (default 24h)")
    revoke = ks.add_parser("revoke", help="revoke a key now",
                           description="Revoke a key now; a running gateway refuses it within 2 s.")
    revoke.add_argument("key_id", help="the id shown by `keys list`")
    for action in (create, listing, rotate, revoke):
        _keys_where(action, argparse.SUPPRESS)
    p.set_defaults(func=cmd_keys)


def _keys_where(parser: Any, default: Any) -> None:
    # Accepted before or after the action (SUPPRESS keeps one given first from being reset).
    parser.add_argument("--policy", default=default, help="the policy whose keys_file to manage")
    parser.add_argument("--keys-file", default=default, help="a keys file to manage directly (no policy checks)")


def _policy_parser(sub: Any) -> None:
    p = sub.add_parser("policy", help="validate a policy or print its JSON Schema")
    ps = p.add_subparsers(dest="policy_cmd", required=True)
    check = ps.add_parser("check", help="validate and explain; exit 0 valid, 1 invalid",
                          description="Validate a policy and its keys file as the gateway would, then "
                          "summarise what it allows. Exit 0 when valid (warnings included), 1 when not; "
                          "a problem is printed as `INVALID file:line: what is wrong`.")
    check.add_argument("file", help="the policy YAML")
    ps.add_parser("schema", help="print the policy JSON Schema (for editors: policies/schema.json)")
    p.set_defaults(func=cmd_policy)


AUDIT_EPILOG = """\
examples:
  portcullis audit --policy policy.yaml --since 24h --status 4xx
  portcullis audit --policy policy.yaml --tenant research --summary
  portcullis audit --policy policy.yaml --decision denied --json | jq .reason
  portcullis audit --policy policy.yaml verify --head HASH_PRINTED_LAST_TIME
  portcullis audit --policy policy.yaml usage --period 2026-11 --json   # chargeback

Filters combine (all must match); rotated files (audit.log.1, .2, ...) are read too, oldest first.
"""


def _audit_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="filter and summarise the audit log; `audit verify` checks the chain",
                       description="Read the audit log: one record per request, filtered.",
                       epilog=AUDIT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", help="audit log (default: from --policy, else ./audit.log)")
    p.add_argument("--policy", help="policy whose audit.path to read")
    p.add_argument("--json", action="store_true", help="one JSON record per line (with --summary: one object)")
    p.add_argument("--summary", action="store_true",
                   help="requests and tokens per principal and tenant, denials by reason, counts by status")
    p.add_argument("--since", type=_time, help="from this time on: ISO (2026-01-31T12:00Z) or back from now (24h)")
    p.add_argument("--until", type=_time, help="before this time (same forms as --since)")
    p.add_argument("--principal", help="key principal or JWT subject")
    p.add_argument("--tenant")
    p.add_argument("--decision", choices=("allowed", "denied", "failed"),
                   help="denied: refused by policy; failed: the engine or the gateway failed")
    p.add_argument("--model")
    p.add_argument("--reason", help="e.g. model_not_allowed, key_revoked, request_rate_limit (see --summary)")
    p.add_argument("--status", type=_status, help="e.g. 429 or 4xx")
    p.add_argument("--keyring", help="the audit keyring (default: secrets/audit-keyring.json beside --policy, "
                   "or $PORTCULLIS_AUDIT_KEYRING)")
    av = p.add_subparsers(dest="audit_cmd", metavar="{verify,usage,rotate-key,init-keyring}")
    verify = av.add_parser("verify", help="check MACs, checkpoint signatures and the chain; exit 1 if a line was "
                           "edited, removed or moved",
                           description="Walk the chain of the log and its rotated files, checking each line's "
                           "HMAC and each checkpoint's Ed25519 signature with the audit keyring. Exit 0 when "
                           "intact, 1 when a record was edited, removed, reordered, cut short or rewritten "
                           "without the key; the first bad line is named. Records cut from the very end show "
                           "against a signed checkpoint, or a head printed earlier (--head). Lines written "
                           "before audit keys existed verify as a plain SHA-256 chain, with a note.")
    verify.add_argument("--keyring", default=argparse.SUPPRESS, help="the audit keyring")
    # SUPPRESS keeps a value given before `verify` from being reset by the sub-parser's default.
    verify.add_argument("--file", default=argparse.SUPPRESS, help="audit log (default: from --policy)")
    verify.add_argument("--policy", default=argparse.SUPPRESS, help="policy whose audit.path to read")
    verify.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="the verdict as JSON")
    verify.add_argument("--head", help="a head hash from an earlier verify, which must still be in the chain")
    rotate = av.add_parser("rotate-key", help="new MAC and checkpoint keys; old ones kept for verification",
                           description="Add new chain (HMAC) and checkpoint (Ed25519) keys to the audit keyring; "
                           "running gateways take them up within a second. The prompt fingerprint key stays, "
                           "so equal prompts still match across the rotation.")
    rotate.add_argument("--keyring", default=argparse.SUPPRESS, help="the audit keyring")
    rotate.add_argument("--policy", default=argparse.SUPPRESS, help="the policy beside whose secrets/ it lies")
    usage = av.add_parser("usage", help="requests and tokens per tenant, principal and model, for chargeback",
                          description="Sum the requests (forwarded, refused, failed) and the prompt and completion "
                          "tokens the engine reported, per tenant, principal and model, over --period (a UTC day "
                          "or month, as budgets count) or --since/--until.")
    usage.add_argument("--period", help="day or month (the current UTC one), or a month (2026-12) or a day (2026-12-01)")
    usage.add_argument("--by", default=",".join(("tenant", "principal", "model")),
                       help="what to group by: a comma-separated subset of tenant,principal,model")
    for name in ("--file", "--policy", "--since", "--until", "--tenant", "--principal", "--model"):
        usage.add_argument(name, default=argparse.SUPPRESS, type=_time if name in ("--since", "--until") else None,
                           help="as for `portcullis audit`")
    usage.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="the rows as one JSON object")
    init = av.add_parser("init-keyring", help="write a new audit keyring (for a secret store or a mounted file)",
                         description="Write a new audit keyring (0600) to FILE, for deployments where the "
                         "gateway cannot create its own (a read-only secret mount).")
    init.add_argument("target", metavar="FILE")
    p.set_defaults(func=cmd_audit, head=None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "engine":
        os.execv(sys.executable, [sys.executable, "-m", "engine", *argv[1:]])
        return 0  # not reached: execv replaces this process
    if argv and argv[0] == "serve":
        from gateway.serve import main as serve

        return serve(argv[1:])
    if argv and argv[0] == "bench":
        from bench.cli import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `portcullis audit ... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
