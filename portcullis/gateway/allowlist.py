"""Route allowlist: reduce a raw request path to one canonical form, then look it up.

The gateway forwards the *listed* path, never the client's spelling of it, so whatever
encoding trick a client tries, the engine only ever sees a path the policy names.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.policy.models import Policy, Route

MODELS_PATH = "/v1/models"
STORED_RESPONSE = re.compile(r"^/v1/responses/(resp_[a-z0-9._:-]{1,128})$")  # GET: a stored Response

_FORBIDDEN = frozenset("\\\x00") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}


def normalise_path(raw_path: bytes) -> str | None:
    """Canonical lower-case path, or None for anything too odd to interpret safely.

    Percent-decoding happens once; a '%' that survives it means double encoding, which only
    ever serves to smuggle a path past one parser and not another, so it is refused.
    """
    try:
        decoded = unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "%" in decoded or any(ch in _FORBIDDEN for ch in decoded):
        return None
    segments: list[str] = []
    for segment in decoded.lower().split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def model_in_path(raw_path: bytes) -> str | None:
    """The model id of a `/v1/models/{id}` path, its case kept (ids are case-sensitive and may
    hold a slash, as "Qwen/Qwen2.5-0.5B"); None when the path is not one, or is odd."""
    path = normalise_path(raw_path)
    if path is None or not path.startswith(MODELS_PATH + "/"):
        return None
    segments = [s for s in unquote_to_bytes(raw_path).decode("utf-8").split("/") if s]
    # Dot segments would make the id differ from what normalisation resolved: refuse them.
    if any(s in (".", "..") for s in segments) or [s.lower() for s in segments[:2]] != ["v1", "models"]:
        return None
    return "/".join(segments[2:])


def stored_response_in_path(method: str, path: str | None) -> str | None:
    """The id of a `GET /v1/responses/{id}` (the Responses API's retrieve), else None."""
    found = STORED_RESPONSE.match(path or "") if method == "GET" else None
    return found[1] if found else None


def match_route(policy: Policy, method: str, path: str | None) -> Route | None:
    if path is None:
        return None
    for route in policy.routes:
        if route.path == path and route.method == method:
            return route
    return None


def route_permits(route: Route, principal: Principal) -> bool:
    """A route with scopes is invisible (404) to principals that hold none of them."""
    return not route.scopes or bool(principal.scopes.intersection(route.scopes))
