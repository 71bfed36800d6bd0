"""`portcullis audit`: filter, summarise and verify the audit log; usage for chargeback; keyring care."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from portcullis.cli.arguments import DURATION, duration, fail, printable, table
from portcullis.gateway.policy.loader import PolicyError, load_policy, resolve_relative


def _audit_path(args: argparse.Namespace) -> Path:
    if args.file:
        return Path(args.file)
    if args.policy:
        loaded = load_policy(args.policy)
        return resolve_relative(loaded.path, loaded.policy.audit.path)
    return Path("audit.log")


def _backups(args: argparse.Namespace) -> int | None:
    """How many rotated files the writer keeps: --backups, else the policy's audit.backups;
    None when neither says (then verify cannot tell a cut head from rotation)."""
    if args.backups is not None:
        return args.backups
    return load_policy(args.policy).policy.audit.backups if args.policy else None


def _keyring_file(args: argparse.Namespace) -> Path | None:
    """--keyring, else the default for --policy (or $PORTCULLIS_AUDIT_KEYRING) if it exists."""
    from portcullis.gateway.audit.keys import KEYRING_ENV, keyring_path

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
    from portcullis.gateway.audit import review
    from portcullis.gateway.audit.keys import AuditKeyring, KeyringError

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
        try:
            backups = _backups(args)
        except PolicyError as exc:
            return fail(str(exc))
        return _verify(review.verify(path, args.head, keyring, backups), args.json)
    if args.audit_cmd == "usage":
        return _usage(path, args)
    flt = review.Filter(since=args.since, until=args.until, principal=args.principal, tenant=args.tenant,
                        status=args.status, decision=args.decision, model=args.model, reason=args.reason,
                        route=args.route)
    found = review.records(path, flt)
    if args.summary:
        summary = review.summarise(found)
        print(json.dumps(summary, indent=2) if args.json else _summary_tables(summary))
    elif args.json:
        for record in found:
            print(json.dumps(record))
    else:
        rows = [{k: r.get(k) for k in AUDIT_COLUMNS} | {"route": r.get("route") or r.get("path")} for r in found]
        print(table(rows) if rows else "no matching records")
    return 0


def _init_keyring(path: Path) -> int:
    from portcullis.gateway.audit.keys import AuditKeyring

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
    from portcullis.gateway.audit.keys import AuditKeyring, KeyringError

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
    from portcullis.gateway.audit import review
    from portcullis.gateway.auth.keys import utcnow

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
        print(table(rows) if rows else "no matching records")
    return 0


AUDIT_COLUMNS = ("time", "request_id", "principal", "tenant", "method", "route", "model", "status",
                 "decision", "reason", "prompt_tokens", "completion_tokens", "latency_ms")


def _verify(verdict: Any, as_json: bool) -> int:
    if as_json:
        print(json.dumps(verdict.__dict__, indent=2))
    else:
        # Notes and problems quote what lines hold (a notice's error text), so they are escaped too.
        for note in verdict.notes:
            print(printable(f"note: {note}"))
        for problem in verdict.problems:
            print(printable(f"TAMPERED {problem}"))
        state = "OK" if verdict.ok else "FAILED"
        where = f"; first bad line {verdict.first_bad}" if verdict.first_bad else ""
        print(printable(f"{state}: {verdict.lines} records ({verdict.keyed} keyed, {verdict.checkpoints} signed "
                        f"checkpoints){where}; head {verdict.head}"))
    return 0 if verdict.ok else 1


def _summary_tables(summary: dict[str, Any]) -> str:
    parts = []
    for title in ("by_principal", "by_tenant"):
        rows = [{"name": name, **row} for name, row in summary[title].items()]
        parts.append(f"{title.replace('_', ' ')}:\n{table(rows)}")
    rows = [{"reason": k, "count": v} for k, v in summary["denials_by_reason"].items()]
    parts.append(f"denials by reason:\n{table(rows)}")
    rows = [{"status": k, "count": v} for k, v in summary["by_status"].items()]
    parts.append(f"by status:\n{table(rows)}")
    return "\n\n".join(parts)


def _time(text: str) -> Any:
    """An ISO time, or a duration back from now (`24h` = the last 24 hours)."""
    from portcullis.gateway.audit.review import parse_time
    from portcullis.gateway.auth.keys import utcnow

    if DURATION.match(text.strip()):
        return utcnow() - duration(text)
    try:
        return parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO time like 2026-01-31T12:00Z "
                                         "or a duration back from now like 24h or 7d") from None


def _backups_kept(text: str) -> int:
    if not text.strip().isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of rotated files (1 or more, as audit.backups)")
    return int(text)


def _status(text: str) -> str:
    if not re.fullmatch(r"[1-5](\d\d|xx)", text.lower()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a status like 429 or a class like 4xx")
    return text.lower()


AUDIT_EPILOG = """\
examples:
  portcullis audit --policy policy.yaml --since 24h --status 4xx
  portcullis audit --policy policy.yaml --tenant research --summary
  portcullis audit --policy policy.yaml --decision denied --json | jq .reason
  portcullis audit --policy policy.yaml verify --head HASH_PRINTED_LAST_TIME
  portcullis audit --policy policy.yaml usage --period 2026-11 --json   # chargeback

Filters combine (all must match); rotated files (audit.log.1, .2, ...) are read too, oldest first.
"""


def add_parser(sub: Any) -> None:
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
    p.add_argument("--route", help="the policy route, e.g. /v1/chat/completions")
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
    verify.add_argument("--backups", type=_backups_kept, metavar="N",
                        help="how many rotated files the writer keeps (default: the policy's audit.backups), "
                        "so records cut from the oldest file's head are told apart from rotation")
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
    p.set_defaults(func=cmd_audit, head=None, backups=None)

