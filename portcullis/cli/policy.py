"""`portcullis policy`: validate a policy as the gateway would, or print its JSON Schema."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from portcullis.gateway.policy.loader import PolicyError, load_policy, resolve_relative


def cmd_policy(args: argparse.Namespace) -> int:
    if args.policy_cmd == "schema":
        from portcullis.gateway.policy.schema import policy_schema

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
    from portcullis.gateway.policy.models import memory_budgets_warning

    found += [w for w in [memory_budgets_warning(p)] if w]
    return found


def add_parser(sub: Any) -> None:
    p = sub.add_parser("policy", help="validate a policy or print its JSON Schema")
    ps = p.add_subparsers(dest="policy_cmd", required=True)
    check = ps.add_parser("check", help="validate and explain; exit 0 valid, 1 invalid",
                          description="Validate a policy and its keys file as the gateway would, then "
                          "summarise what it allows. Exit 0 when valid (warnings included), 1 when not; "
                          "a problem is printed as `INVALID file:line: what is wrong`.")
    check.add_argument("file", help="the policy YAML")
    ps.add_parser("schema", help="print the policy JSON Schema (for editors: policies/schema.json)")
    p.set_defaults(func=cmd_policy)

