"""Find the credential in a request and resolve it to a `Principal` (or refuse)."""

from __future__ import annotations

import hashlib
from datetime import datetime
from urllib.parse import parse_qsl

from starlette.datastructures import Headers

from portcullis.gateway.auth.apikeys import authenticate_key, authenticate_static_key
from portcullis.gateway.auth.certs import authenticate_client_cert
from portcullis.gateway.auth.keys import PREFIX, split_key
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.auth.tokens import JwksCache, authenticate_jwt
from portcullis.gateway.errors import Refusal
from portcullis.gateway.policy.loader import LoadedPolicy

# Query parameters that look like someone put a credential in a URL (and so in every log
# and proxy between them and us). Refusing teaches the client before the key leaks again.
CREDENTIAL_PARAMS = frozenset(
    {"api_key", "api-key", "apikey", "key", "token", "access_token", "authorization", "jwt", "auth"}
)


def credentials_in_query(query_string: bytes) -> bool:
    if not query_string:
        return False
    for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
        if name.lower() in CREDENTIAL_PARAMS or value.startswith((PREFIX, "eyJ", "Bearer")):
            return True
    return False


def bearer_token(headers: Headers) -> str | None:
    """The presented credential: `Authorization: Bearer` first, else `x-api-key`."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refusal(401, "Use 'Authorization: Bearer <key>' (or 'x-api-key: <key>').", "malformed_credentials")
        return token.strip()
    api_key = headers.get("x-api-key")
    return api_key.strip() if api_key else None


def credential_tag(headers: Headers) -> str:
    """A short name for the credential a request presents, never the secret itself: the key's
    public id, or a digest of anything else. Failed attempts are throttled per credential."""
    try:
        token = bearer_token(headers)
    except Refusal:
        return "malformed"
    if token is None:
        return "none"
    parts = split_key(token)
    if parts is not None:
        return "key:" + parts[0][:32]
    return "digest:" + hashlib.sha256(token.encode()).hexdigest()[:24]


async def authenticate(
    headers: Headers, loaded: LoadedPolicy, jwks: JwksCache, now: datetime, client_cert: tuple[str, ...] = ()
) -> Principal:
    """A presented key or token decides; without one, a verified TLS client certificate's names."""
    token = bearer_token(headers)
    if token is None and client_cert:
        return authenticate_client_cert(client_cert, loaded)
    if token is None:
        raise Refusal(401, "Missing API key or token.", "missing_credentials")
    if token.startswith(PREFIX):
        return authenticate_key(token, loaded, now)
    if token.count(".") == 2:
        return await authenticate_jwt(token, loaded, jwks)
    return authenticate_static_key(token, loaded, now)
