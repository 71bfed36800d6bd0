"""The console's writes, for principals holding the policy's `console.write_scope` (unset: none):

    POST {console.path}/api/keys               create a key in the keys file (its token shown once)
    POST {console.path}/api/keys/{id}/revoke   revoke a key of the keys file
    POST {console.path}/api/policy/check       validate a policy text, write nothing
    POST {console.path}/api/policy             save a policy text that validates

Each needs the `x-portcullis-console: 1` header, which the console's page sends and no other
site can (a cross-origin request with it needs a CORS grant the gateway never gives; requests a
browser marks cross-site were refused before this). Bodies are JSON objects of at most 1 MiB,
read and parsed by the proxy's own bounded reader (`gateway.body`). The files are changed in the
console's thread as the command line changes them: keys under the keys file's lock (`portcullis
keys`), the policy validated first, then renamed into place whole. Each change is applied at
once and written to the audit log as an `admin_action`
line with its diff; a write that changes nothing writes no such line.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import re
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from portcullis.gateway import body as bodies
from portcullis.gateway.auth.keys import KeyBook, new_key, utcnow
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.console.common import API, iso, limiter, response_headers
from portcullis.gateway.errors import NOT_FOUND, Refusal
from portcullis.gateway.policy.loader import PolicyError, key_problem, load_policy, resolve_relative
from portcullis.gateway.policy.models import ID_PATTERN
from portcullis.gateway.proxy_call import ProxyCall

WRITE_HEADER = "x-portcullis-console"
# One policy save at a time, from its generation check to its reload: a second editor who
# started from the same generation then sees the first one's and gets the 409.
_SAVING = asyncio.Lock()
BODY_MAX = 1 << 20
REVOKE = re.compile(r"keys/([a-z0-9]{8,32})/revoke")


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    principal: str = Field(pattern=ID_PATTERN)
    tenant: str = Field(pattern=ID_PATTERN)
    scopes: list[str] = Field(default_factory=list, max_length=32)
    models: list[str] | None = Field(None, max_length=256)
    expires_in_days: int | None = Field(None, ge=1, le=3650)
    note: str = Field("", max_length=200)


class PolicyEdit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(max_length=BODY_MAX)
    base_generation: int | None = None  # required to save; a check needs none


async def write(call: ProxyCall, principal: Principal, rest: str) -> Response:
    console, record = call.policy.policy.console, call.record
    name = rest.removeprefix(API) if rest.startswith(API) else None
    revoke = REVOKE.fullmatch(name or "")
    action = {"keys": _create, "policy/check": _check, "policy": _save}.get(name or "") or (
        (lambda c, p, body: _revoke(c, p, revoke.group(1))) if revoke else None)
    if action is None:
        raise NOT_FOUND
    record.route = console.path + API + ("keys/{id}/revoke" if revoke else name)
    if call.request.headers.get(WRITE_HEADER) != "1":
        raise Refusal(403, f"A console write needs the {WRITE_HEADER}: 1 header (the console's page sends it).",
                      "console_write_unconfirmed")
    if console.write_scope is None or console.write_scope not in principal.scopes:
        raise Refusal(403, "The policy keeps the console read-only for you (console.write_scope).",
                      "console_read_only")
    body = None if revoke else bodies.parse_json(await bodies.read_body(call.request, BODY_MAX))
    result = await action(call, principal, body)
    record.finish(200, "allowed", "ok")
    return JSONResponse(result, headers=response_headers(record.request_id))


def _parsed(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise Refusal(400, f"{field}: {first['msg']}", "invalid_console_write", param=field) from None


def _keys_path(call: ProxyCall) -> Path:
    keys_file = call.policy.policy.keys_file
    if not keys_file:
        raise Refusal(409, "This policy lists no keys_file: change keys in the policy file itself.", "keys_not_managed")
    return resolve_relative(call.policy.path, keys_file)


def _admin_action(call: ProxyCall, actor: Principal, action: str, **fields: Any) -> None:
    call.gateway.audit.write(event="admin_action", action=action, actor=actor.id, actor_tenant=actor.tenant,
                             via="console", request_id=call.record.request_id, **fields)


async def _revoke(call: ProxyCall, principal: Principal, key_id: str) -> dict[str, Any]:
    path = _keys_path(call)
    try:
        revoked, changed = await anyio.to_thread.run_sync(lambda: KeyBook(path).revoke(key_id),
                                                          limiter=limiter())
    except KeyError:
        raise Refusal(404, f"No key {key_id} in the keys file.", "key_not_found") from None
    when = iso(revoked.revoked_at)
    if changed:
        _admin_action(call, principal, "key_revoked", key_id=revoked.id, principal=revoked.principal,
                      tenant=revoked.tenant, diff={"revoked_at": [None, when]})
        await call.gateway.store.reload_if_changed()  # refused from the next request on
    return {"id": revoked.id, "revoked_at": when, "changed": changed}


async def _create(call: ProxyCall, principal: Principal, body: dict[str, Any]) -> dict[str, Any]:
    """A new key, checked as `portcullis keys create` checks it (its tenant and principal exist,
    no duplicate id); the token is in this answer only, the keys file keeps its hash."""
    wanted: NewKey = _parsed(NewKey, body)
    path = _keys_path(call)
    expires = utcnow() + timedelta(days=wanted.expires_in_days) if wanted.expires_in_days else None
    token, created = new_key(wanted.principal, wanted.tenant, wanted.scopes, expires, wanted.note, wanted.models)
    loaded = call.gateway.store.current
    problem = key_problem(loaded.policy, loaded.keys, created)
    if problem:
        raise Refusal(400, problem.replace(f"key {created.id!r}", "the new key", 1) + "; no key was created",
                      "invalid_console_write")
    await anyio.to_thread.run_sync(lambda: KeyBook(path).add(created), limiter=limiter())
    shown = created.model_dump(mode="json", exclude={"hash"}, exclude_none=True)
    _admin_action(call, principal, "key_created", key_id=created.id, principal=created.principal,
                  tenant=created.tenant, diff={"added": shown})
    await call.gateway.store.reload_if_changed()  # usable on its first request
    return {**shown, "token": token}


def _validated(policy_path: Path, text: str) -> None:
    """Load `text` as the policy would be loaded from `policy_path` (its relative files found
    beside it), from a temporary file there; PolicyError names the real file."""
    fd, tmp = tempfile.mkstemp(dir=policy_path.parent, prefix=".console-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        try:
            load_policy(tmp)
        except PolicyError as exc:
            raise PolicyError(policy_path if exc.path == tmp else exc.path, exc.line, exc.reason) from None
    finally:
        Path(tmp).unlink(missing_ok=True)


async def _check(call: ProxyCall, principal: Principal, body: dict[str, Any]) -> dict[str, Any]:
    edit: PolicyEdit = _parsed(PolicyEdit, body)
    try:
        await anyio.to_thread.run_sync(_validated, call.gateway.store.path, edit.text, limiter=limiter())
    except PolicyError as exc:
        return {"valid": False, "error": str(exc), "line": exc.line}
    return {"valid": True, "error": None, "line": None}


async def _save(call: ProxyCall, principal: Principal, body: dict[str, Any]) -> dict[str, Any]:
    """Save a policy text that validates, in place of the file, whole; refused when someone
    changed the policy since `base_generation`, or when the file is a link (a ConfigMap or a
    checkout: change it where it comes from)."""
    edit: PolicyEdit = _parsed(PolicyEdit, body)
    async with _SAVING:
        return await _save_now(call, principal, edit)


async def _save_now(call: ProxyCall, principal: Principal, edit: PolicyEdit) -> dict[str, Any]:
    store = call.gateway.store
    if edit.base_generation != store.generation:
        raise Refusal(409, f"The policy changed since you loaded it (generation {store.generation} serves now); "
                      "load it again and redo the edit.", "policy_changed", param="base_generation")
    if store.path.is_symlink():
        raise Refusal(409, "The policy file is a link (a ConfigMap or Secret?): change it where it comes from.",
                      "policy_not_editable")
    before = await anyio.to_thread.run_sync(store.path.read_text, limiter=limiter())
    if edit.text == before:
        return {"saved": False, "generation": store.generation}
    try:
        await anyio.to_thread.run_sync(_replace, store.path, edit.text, limiter=limiter())
    except PolicyError as exc:
        raise Refusal(400, str(exc), "invalid_policy") from None
    await store.reload_if_changed()
    diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), edit.text.splitlines(keepends=True),
                                        "policy (before)", "policy (after)"))
    _admin_action(call, principal, "policy_edited", generation=store.generation, diff=diff)
    return {"saved": True, "generation": store.generation}


def _replace(policy_path: Path, text: str) -> None:
    """Validate, then put `text` in place of the file in one rename, with the file's own mode."""
    _validated(policy_path, text)
    fd, tmp = tempfile.mkstemp(dir=policy_path.parent, prefix=".console-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, policy_path.stat().st_mode & 0o7777)
        os.replace(tmp, policy_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
