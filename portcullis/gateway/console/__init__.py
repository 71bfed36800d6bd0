"""The console: what a reviewer or an on-call admin reads (and, where allowed, changes) in a
browser, without the command line; its pages and their JSON API (`reads`, `writes`).

    GET {console.path}/api/audit    records that pass the filters, newest first
    GET {console.path}/api/export   the same records, oldest first, as JSON lines or CSV (a download)
    GET {console.path}/api/verify   the chain's verification (the code of `portcullis audit verify`)
    GET {console.path}/api/usage    requests, refusals and tokens per tenant, principal and model,
                                    and per hour (a day) or per day (a month)
    GET {console.path}/api/budgets  each budget and rate limit against what the audit log counts
    GET {console.path}/api/keys     the API keys (id, principal, tenant, dates, last use, effective
                                    limits; never a secret or hash)
    GET {console.path}/api/policy   the policy in force: generation, when applied, any refused edit
    GET {console.path}/api/fleet    the engines behind the gateway: health and load
    GET {console.path}/api/policy/text   the policy file as it is on disk
    POST ... (`writes`)             only for `console.write_scope` (unset: nobody)

Read-only unless the policy names a `console.write_scope`: then its holders may create and
revoke keys and edit the policy (`writes`), each write an `admin_action` audit line with
its diff. Reached only by a principal that holds the policy's `console.scope` (default `admin`;
API key, JWT or mTLS as for any route); anyone else gets the gateway's plain 404, so the console
reveals nothing of itself. Each call is one audit line. The log's files are read in a worker
thread, one console query at a time (the next waits its turn): however large the log, the event
loop keeps proxying and a burst of console calls cannot take the thread pool. Every query
parameter is bounded before any file is read.

The pages (`{console.path}`, a single page over the API, and its script and style) ask the same
scope. A browser logs in by HTTP Basic (any user name, the API key or JWT as the password: a
401 here carries the challenge), or by mTLS where configured. No page has an inline script or
style, every asset comes from the gateway (a strict Content-Security-Policy), and a request a
browser marks cross-site (`Sec-Fetch-Site`, or an `Origin` of another host) gets the plain 404,
credentials or not: another site can neither read the console nor make a browser act in it.
"""


from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from urllib.parse import urlsplit

import anyio
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from portcullis.gateway.console import reads, writes
from portcullis.gateway.console.common import API, VALUE_MAX, bad, limiter, response_headers
from portcullis.gateway.errors import NOT_FOUND, Refusal
from portcullis.gateway.proxy_call import ProxyCall

# The page and its two assets: file, content type. The page names its assets under the prefix.
PAGES = {"": ("index.html", "text/html; charset=utf-8"),
         "/static/console.js": ("console.js", "text/javascript; charset=utf-8"),
         "/static/console.css": ("console.css", "text/css; charset=utf-8")}

CHALLENGE = 'Basic realm="Portcullis", charset="UTF-8"'
METHODS = frozenset({"GET", "POST"})


def under(path: str | None, prefix: str) -> bool:
    """Whether a normalised path (None: refused by normalisation) is the console's."""
    return path is not None and (path == prefix or path.startswith(prefix + "/"))


async def serve(call: ProxyCall, path: str, authenticate: Callable) -> Response:
    """One console call: cross-site requests and principals without the scope get the plain
    404 whatever the path; then the page, an asset, or an endpoint (its parameters, then the
    read in the console's thread)."""
    console, record = call.policy.policy.console, call.record
    record.route = console.path + "/*"  # audited even if refused, without echoing a guessed path
    if _cross_site(call.request):
        raise NOT_FOUND
    call.request = _basic_as_bearer(call.request)
    try:
        principal = await authenticate(call)
    except Refusal as refusal:
        if refusal.status != 401:
            raise
        raise Refusal(refusal.status, refusal.message, refusal.reason, param=refusal.param,
                      headers={**refusal.headers, "www-authenticate": CHALLENGE}, principal=refusal.principal) from None
    if console.scope not in principal.scopes:
        raise NOT_FOUND
    rest = path[len(console.path):]
    if call.request.method == "POST":
        return await writes.write(call, principal, rest)
    if rest in PAGES:
        record.route = console.path + rest
        name, media_type = PAGES[rest]
        record.finish(200, "allowed", "ok")
        return Response(_asset(name, console.path), media_type=media_type, headers=response_headers(record.request_id))
    if rest == API + "export":
        return reads.export(call, principal, _bounded(call.request.query_params))
    endpoint = reads.ENDPOINTS.get(rest.removeprefix(API)) if rest.startswith(API) else None
    if endpoint is None:
        raise NOT_FOUND
    record.route = console.path + rest
    params = _bounded(call.request.query_params)
    body = await anyio.to_thread.run_sync(endpoint, call.gateway, params, limiter=limiter())
    record.finish(200, "allowed", "ok")
    return JSONResponse(body, headers=response_headers(record.request_id))


def _cross_site(request: Request) -> bool:
    """What a browser marks as coming from another site (a page elsewhere that fetches, posts or
    embeds): never served, so stolen ambient credentials (Basic, client certificates) buy nothing."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return True
    origin = request.headers.get("origin")
    return origin is not None and urlsplit(origin).netloc != request.headers.get("host")


def _basic_as_bearer(request: Request) -> Request:
    """HTTP Basic (a browser's login prompt) carries the key or JWT as its password: the request
    as if it had come as `Authorization: Bearer`, for the one authentication every route uses."""
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return request
    try:
        password = base64.b64decode(encoded, validate=True).decode().partition(":")[2]
    except (binascii.Error, UnicodeDecodeError):
        return request  # authentication refuses it as it is
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"authorization"]
    headers.append((b"authorization", b"Bearer " + password.encode()))
    return Request({**request.scope, "headers": headers}, request.receive)


@cache
def _asset(name: str, prefix: str) -> bytes:
    text = resources.files("portcullis.gateway.console").joinpath("static", name).read_text(encoding="utf-8")
    return text.replace("{{PREFIX}}", prefix).encode()


def _bounded(query: Mapping[str, str]) -> dict[str, str]:
    params = {}
    for key, value in query.items():
        if len(key) > VALUE_MAX or len(value) > VALUE_MAX:
            raise bad(key[:40], f"query values are at most {VALUE_MAX} characters")
        params[key] = value
    return params
