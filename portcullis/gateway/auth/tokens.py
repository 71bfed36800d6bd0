"""JWT authentication with PyJWT: RS256/ES256 from a JWKS, HS256 from a secret.

The algorithm is checked against the policy *before* any key is chosen, and the key is
chosen by the algorithm's family, so `alg: none` and HS256-signed-with-the-RSA-public-key
tokens are refused whatever the token says.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import structlog

from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.errors import Refusal
from portcullis.gateway.policy.loader import LoadedPolicy, resolve_relative
from portcullis.gateway.policy.models import JwtSettings

log = structlog.get_logger("portcullis.gateway.auth")

KEY_TYPE_FOR_ALG = {"RS256": "RSA", "ES256": "EC"}
JWT_ERRORS: list[tuple[type[Exception], str, str]] = [
    (jwt.ExpiredSignatureError, "jwt_expired", "The token has expired."),
    (jwt.ImmatureSignatureError, "jwt_not_yet_valid", "The token is not valid yet."),
    (jwt.InvalidIssuerError, "jwt_wrong_issuer", "The token's issuer is not accepted."),
    (jwt.InvalidAudienceError, "jwt_wrong_audience", "The token's audience is not accepted."),
    (jwt.InvalidSignatureError, "jwt_bad_signature", "The token's signature is invalid."),
    (jwt.MissingRequiredClaimError, "jwt_missing_claim", "The token lacks a required claim."),
    (jwt.exceptions.InvalidSubjectError, "jwt_invalid_claim", "The token's 'sub' claim must be a string."),
]


def _refuse(reason: str, message: str = "Invalid token.") -> Refusal:
    return Refusal(401, message, reason)


class JwksCache:
    """Public keys by `kid`, reloaded when an unknown `kid` shows up (at most so often)."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._transport = transport  # tests inject a mock; production uses the network
        self._keys: dict[str, jwt.PyJWK] = {}
        self._source: str | None = None
        self._stamp: float | int = 0
        self._last_fetch = 0.0

    async def get(self, kid: str, settings: JwtSettings, policy_path: Path) -> jwt.PyJWK | None:
        source = self._source_for(settings, policy_path)
        if source != self._source:
            self._keys, self._source, self._stamp, self._last_fetch = {}, source, 0, 0.0
        if kid not in self._keys:
            await self._refresh(settings, source)
        return self._keys.get(kid)

    @staticmethod
    def _source_for(settings: JwtSettings, policy_path: Path) -> str:
        if settings.jwks_file:
            return str(resolve_relative(policy_path, settings.jwks_file))
        return settings.jwks_url or ""

    async def _refresh(self, settings: JwtSettings, source: str) -> None:
        try:
            if settings.jwks_file:
                self._reload_file(Path(source))
            elif time.monotonic() - self._last_fetch >= settings.jwks_refresh_min_seconds:
                self._last_fetch = time.monotonic()
                await self._fetch(source)
        except (OSError, ValueError, httpx.HTTPError, jwt.PyJWKError) as exc:
            # Keep serving the keys we had: a flaky JWKS endpoint must not log everyone out.
            log.warning("jwks_refresh_failed", source=source, error=str(exc))

    def _reload_file(self, path: Path) -> None:
        stamp = path.stat().st_mtime_ns
        if stamp != self._stamp:
            self._keys = _parse_jwks(json.loads(path.read_text()))
            self._stamp = stamp

    async def _fetch(self, url: str) -> None:
        async with httpx.AsyncClient(transport=self._transport, timeout=5.0, follow_redirects=False) as client:
            response = await client.get(url)
            response.raise_for_status()
            self._keys = _parse_jwks(response.json())


def _parse_jwks(data: dict[str, Any]) -> dict[str, jwt.PyJWK]:
    keys = {}
    for entry in data.get("keys", []):
        if "kid" in entry and entry.get("use", "sig") == "sig":
            keys[entry["kid"]] = jwt.PyJWK.from_dict(entry)
    return keys


async def _key_for(header: dict[str, Any], settings: JwtSettings, jwks: JwksCache, path: Path) -> Any:
    alg = header["alg"]
    if alg == "HS256":
        secret = os.environ.get(settings.hs256_secret_env or "", "")
        if len(secret) < 32:
            raise _refuse("jwt_no_secret", "HS256 is not configured on this gateway.")
        return secret.encode()
    kid = header.get("kid")
    key = await jwks.get(kid, settings, path) if isinstance(kid, str) else None
    if key is None or key.key_type != KEY_TYPE_FOR_ALG[alg]:
        raise _refuse("jwt_unknown_kid", "The token's signing key is not known.")
    return key.key


def _decode(token: str, key: Any, alg: str, settings: JwtSettings) -> dict[str, Any]:
    try:
        return jwt.decode(
            token,
            key,
            algorithms=[alg],
            audience=settings.audience,
            issuer=settings.issuer,
            leeway=settings.leeway_seconds,
            options={"require": ["exp", "iss", "aud", settings.claims.principal]},
        )
    except jwt.PyJWTError as exc:
        for kind, reason, message in JWT_ERRORS:
            if isinstance(exc, kind):
                raise _refuse(reason, message) from None
        raise _refuse("jwt_invalid") from None


MAX_CLAIM_CHARS = 256  # a principal or tenant name; policy ids are at most 128


def _bad_claim(name: str, expected: str) -> Refusal:
    return _refuse("jwt_invalid_claim", f"The token's '{name}' claim must be {expected}.")


def _name_claim(claims: dict[str, Any], name: str, default: str | None = None) -> str | None:
    """A principal or tenant claim: a short non-empty string (or absent, for the default)."""
    value = claims.get(name)
    if value is None:
        return default
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CLAIM_CHARS:
        raise _bad_claim(name, f"a string of 1 to {MAX_CLAIM_CHARS} characters")
    return value


def _scope_claim(claims: dict[str, Any], name: str) -> set[str]:
    """OAuth's space-separated string, or a list of strings (as some IdPs issue `scp`)."""
    raw = claims.get(name)
    if raw is None:
        return set()
    if isinstance(raw, str):
        return set(raw.split())
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return set(raw)
    raise _bad_claim(name, "a space-separated string or a list of strings")


def _principal(claims: dict[str, Any], settings: JwtSettings, loaded: LoadedPolicy) -> Principal:
    subject = _name_claim(claims, settings.claims.principal)
    if subject is None:
        raise _refuse("jwt_missing_claim", "The token lacks a principal.")
    tenant = _name_claim(claims, settings.claims.tenant, settings.default_tenant)
    rule = loaded.policy.principals.get(subject)
    if tenant not in loaded.policy.tenants or (rule and rule.tenant != tenant):
        raise Refusal(403, "The token's tenant is not allowed here.", "jwt_unknown_tenant")
    scopes = _scope_claim(claims, settings.claims.scopes) | set(rule.scopes if rule else ())
    return Principal(subject, tenant, frozenset(scopes), None, "jwt")


async def authenticate_jwt(token: str, loaded: LoadedPolicy, jwks: JwksCache) -> Principal:
    settings = loaded.policy.jwt
    if settings is None:
        raise _refuse("invalid_credentials", "Invalid credentials.")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise _refuse("jwt_malformed") from None
    if header.get("alg") not in settings.algorithms:
        raise _refuse("jwt_algorithm_refused", "The token's algorithm is not accepted.")
    key = await _key_for(header, settings, jwks, loaded.path)
    claims = _decode(token, key, header["alg"], settings)
    return _principal(claims, settings, loaded)
