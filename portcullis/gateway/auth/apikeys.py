"""API-key authentication against the hashed records of the current policy."""

from __future__ import annotations

from datetime import datetime

from portcullis.gateway.auth.keys import (
    hash_secret,
    key_state,
    secret_matches,
    split_key,
    static_key_id,
)
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.errors import Refusal
from portcullis.gateway.policy.loader import LoadedPolicy

# Verified against when the key id is unknown, so a miss costs the same as a wrong secret.
_DECOY_HASH = hash_secret("decoy")


def invalid_key() -> Refusal:
    return Refusal(401, "Invalid API key.", "invalid_key")


def authenticate_key(token: str, loaded: LoadedPolicy, now: datetime) -> Principal:
    parts = split_key(token)
    if parts is None:
        raise invalid_key()
    return _check(*parts, loaded, now)


def authenticate_static_key(token: str, loaded: LoadedPolicy, now: datetime) -> Principal:
    """A key in no format of ours (vLLM-style `--api-key`): its record id derives from it."""
    if not 16 <= len(token) <= 256:
        raise invalid_key()
    return _check(static_key_id(token), token, loaded, now)


def _check(key_id: str, secret: str, loaded: LoadedPolicy, now: datetime) -> Principal:
    record = loaded.keys.get(key_id)
    if not secret_matches(secret, record.hash if record else _DECOY_HASH) or record is None:
        raise invalid_key()
    # State is revealed only to a caller who proved it holds the secret.
    state = key_state(record, now)
    if state != "active":
        holder = Principal(record.principal, record.tenant, frozenset(), key_id, "api_key")
        raise Refusal(401, f"This API key is {state}.", f"key_{state}", principal=holder)
    rule = loaded.policy.principals.get(record.principal)
    scopes = set(record.scopes) | set(rule.scopes if rule else ())
    return Principal(record.principal, record.tenant, frozenset(scopes), key_id, "api_key")
