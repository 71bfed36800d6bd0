"""API keys: the token format, how a secret is hashed, and the CLI-managed keys file.

A key reads `ptc_<id>.<secret>`: the id is public and finds the record in O(1); the secret
(32 random bytes) is stored only as `hmac-sha256$<salt>$<digest>`.

Why HMAC-SHA256 and not a slow KDF: slow hashes (bcrypt, scrypt, Argon2) exist to protect
low-entropy passwords from offline guessing. A 256-bit random secret cannot be guessed
however fast the hash is, so a salted HMAC is exactly as safe here, and it costs about a
microsecond per request instead of the 50–100 ms a password KDF would add to every call.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

from portcullis.gateway.policy.loader import load_keys_file
from portcullis.gateway.policy.models import KeyRecord, KeysFile

PREFIX = "ptc_"
HASH_SCHEME = "hmac-sha256"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hmac.new(salt, secret.encode(), hashlib.sha256).digest()
    return f"{HASH_SCHEME}${_b64(salt)}${_b64(digest)}"


def secret_matches(secret: str, stored: str) -> bool:
    """Constant-time comparison of a presented secret with a stored hash."""
    try:
        scheme, salt, digest = stored.split("$")
        expected = _unb64(digest)
        actual = hmac.new(_unb64(salt), secret.encode(), hashlib.sha256).digest()
    except ValueError:
        return False
    return scheme == HASH_SCHEME and hmac.compare_digest(actual, expected)


def split_key(token: str) -> tuple[str, str] | None:
    """`ptc_<id>.<secret>` -> (id, secret), or None for anything that is not a key."""
    if not token.startswith(PREFIX) or len(token) > 256:
        return None
    key_id, sep, secret = token[len(PREFIX) :].partition(".")
    if not sep or not key_id or not secret:
        return None
    return key_id, secret


def new_key(
    principal: str,
    tenant: str,
    scopes: list[str],
    expires_at: datetime | None = None,
    note: str = "",
    models: list[str] | None = None,
) -> tuple[str, KeyRecord]:
    """Make a key: returns the full token (shown once) and the record to store."""
    key_id = secrets.token_hex(6)
    secret = _b64(secrets.token_bytes(32))
    record = KeyRecord(
        id=key_id,
        principal=principal,
        tenant=tenant,
        scopes=scopes,
        models=models,
        hash=hash_secret(secret),
        created_at=utcnow(),
        expires_at=expires_at,
        note=note,
    )
    return f"{PREFIX}{key_id}.{secret}", record


def static_key_id(token: str) -> str:
    """The record id of a static key (vLLM's `--api-key`, any text): derived from the key itself,
    since such a key carries no id of its own to look its record up by."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def new_static_key(token: str, principal: str, tenant: str, scopes: list[str]) -> KeyRecord:
    """A record for a key the operator chose; stored, like every key, only as a salted hash."""
    return KeyRecord(id=static_key_id(token), principal=principal, tenant=tenant, scopes=scopes,
                     hash=hash_secret(token), created_at=utcnow(), note="static key (--api-key / VLLM_API_KEY)")


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def key_state(record: KeyRecord, now: datetime) -> str:
    """'active', 'revoked' or 'expired' at `now`."""
    if record.revoked_at is not None and record.revoked_at <= now:
        return "revoked"
    if record.expires_at is not None and record.expires_at <= now:
        return "expired"
    return "active"


HEADER = (
    "# Portcullis API keys - written by `portcullis keys`; edits by hand are fine but\n"
    "# this file holds only salted hashes: a lost key cannot be recovered, only rotated.\n"
    "# One key a line, in YAML's JSON-compatible style: the gateway reads it fastest.\n"
)


def keys_file_text(keys: KeysFile) -> str:
    """YAML in its JSON-compatible flow style, one record a line: any YAML tool reads it, a
    diff shows one line per changed key, and the gateway parses thousands in milliseconds."""
    lines = ",\n".join("  " + json.dumps(r.model_dump(mode="json"), ensure_ascii=False) for r in keys.keys)
    return f'{HEADER}{{"version": {keys.version}, "keys": [' + (f"\n{lines}\n" if lines else "") + "]}\n"


def write_keys_file(path: Path, keys: KeysFile) -> None:
    """Atomic replace (temp file, fsync, rename) so the gateway never reads a half-written file."""
    text = keys_file_text(keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".keys-", suffix=".tmp")  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a crash


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the keys file's lock (a sibling `.NAME.lock`) for one read-modify-write: two `keys`
    commands at once would otherwise each write back what they read, and one change is lost."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class KeyBook:
    """Create, revoke and rotate records in a keys file (the CLI's side of keys).

    Every change re-reads the file under its lock and writes it before letting go, so
    concurrent commands (and scripts) never lose each other's changes.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.keys = load_keys_file(path)

    @contextlib.contextmanager
    def _editing(self) -> Iterator[None]:
        with locked(self.path):
            self.keys = before = load_keys_file(self.path)
            yield
            if self.keys is not before:
                write_keys_file(self.path, self.keys)

    def _put(self, records: list[KeyRecord]) -> None:
        self.keys = KeysFile(keys=records)

    def find(self, key_id: str) -> KeyRecord:
        for record in self.keys.keys:
            if record.id == key_id:
                return record
        raise KeyError(f"no key with id {key_id!r} in {self.path} (`portcullis keys ... list` shows the ids)")

    def add(self, record: KeyRecord) -> None:
        with self._editing():
            self._put([*self.keys.keys, record])

    def replace(self, record: KeyRecord) -> None:
        with self._editing():
            self.find(record.id)
            self._put([record if r.id == record.id else r for r in self.keys.keys])

    def revoke(self, key_id: str) -> tuple[KeyRecord, bool]:
        """Revoke now; (the record, False) when it was already revoked: the first time is the one
        that matters, so it is kept and nothing is written."""
        with self._editing():
            record = self.find(key_id)
            if record.revoked_at is not None:
                return record, False
            record = record.model_copy(update={"revoked_at": utcnow()})
            self._put([record if r.id == key_id else r for r in self.keys.keys])
        return record, True

    def rotate(self, key_id: str, overlap: timedelta) -> tuple[str, KeyRecord, KeyRecord]:
        """New key for the same principal; the old one keeps working for `overlap`."""
        with self._editing():
            old = self.find(key_id)
            token, new = _successor(old, key_id)
            ends = utcnow() + overlap
            update: dict[str, object] = {"replaced_by": new.id}
            if old.expires_at is None or old.expires_at > ends:
                update["expires_at"] = ends
            old = old.model_copy(update=update)
            self._put([old if r.id == old.id else r for r in self.keys.keys] + [new])
        return token, new, old


def _successor(old: KeyRecord, key_id: str) -> tuple[str, KeyRecord]:
    """A new key with `old`'s principal, tenant, scopes, models and expiry, if `old` may be rotated."""
    state = key_state(old, utcnow())
    if state != "active":
        raise ValueError(f"key {key_id!r} is {state}, so there is nothing to rotate; "
                         "create a new key with `portcullis keys ... create` instead")
    if old.replaced_by is not None:
        raise ValueError(f"key {key_id!r} was already rotated to {old.replaced_by!r}; rotate that one")
    return new_key(old.principal, old.tenant, list(old.scopes), old.expires_at, old.note,
                   list(old.models) if old.models is not None else None)
