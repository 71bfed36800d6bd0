"""`portcullis keys`: create, list, rotate and revoke API keys; only salted hashes are written."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from portcullis.cli.arguments import duration, fail, name, positive_duration, table
from portcullis.gateway.policy.loader import PolicyError, key_problem, load_policy, resolve_relative


def _keys_path(args: argparse.Namespace) -> tuple[Path, Any]:
    if args.keys_file:
        return Path(args.keys_file), None
    loaded = load_policy(args.policy)
    if not loaded.policy.keys_file:
        raise PolicyError(args.policy, None, "the policy names no keys_file; add `keys_file: keys.yaml` to it "
                          "or pass --keys-file")
    return resolve_relative(loaded.path, loaded.policy.keys_file), loaded


def cmd_keys(args: argparse.Namespace) -> int:
    from portcullis.gateway.auth.keys import KeyBook

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
    from portcullis.gateway.auth.keys import new_key, utcnow

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
    from portcullis.gateway.auth.keys import key_state

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
    from portcullis.gateway.auth.keys import key_state, utcnow

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
    print(table(rows) if rows else f"no keys in {book.path}")
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

    from portcullis.gateway.audit.keys import (
        AuditKeyring,
        KeyringError,
        check_outside,
        keyring_path,
    )
    from portcullis.gateway.audit.log import ChainedFile, utc_stamp

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


KEYS_EPILOG = """\
examples:
  portcullis keys --policy policy.yaml create --principal alice --tenant research --expires-in 90d
  portcullis keys --policy policy.yaml list
  portcullis keys --policy policy.yaml rotate KEY_ID --overlap 24h
  portcullis keys --policy policy.yaml revoke KEY_ID

Keys are written to the file the policy's keys_file names (never to the policy itself), as
salted hashes only. A running gateway applies every change within 2 s; a new key works on
its first request (an unknown key makes the gateway read a changed keys file at once).
"""


def add_parser(sub: Any) -> None:
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

