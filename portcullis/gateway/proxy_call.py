"""`ProxyCall`: one client request on its way through the proxy, from the route to the engine's
answer; each step of `gateway.routers.proxy` reads it and fills in its own part.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from portcullis.gateway.access import Access
from portcullis.gateway.audit.record import RequestRecord
from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.body import PromptCount
from portcullis.gateway.policy.loader import LoadedPolicy
from portcullis.gateway.ratelimit import Admission
from portcullis.gateway.state import GatewayState


@dataclass
class Upstream:
    """What to send to the engine for one request that passed every check."""

    method: str
    path: str
    body: bytes | None
    stream: bool
    strip_usage_chunk: bool
    prompt_bytes: int
    prompt_count: PromptCount | None = None  # set when the prompt must be counted by the engine
    sequences: int = 1  # n x prompts, counted against concurrency limits
    reserve_tokens: int = 0  # worst-case cost, held against tokens_per_minute until settled
    model: str | None = None  # picks the upstream group (None: any replica)
    affinity: tuple[bytes, ...] = ()  # the leading text's chunk hashes (gateway.upstream.fleet)


@dataclass
class ProxyCall:
    """The request and what the gateway learns of it, in the order the proxy learns it.

    `request`, `gateway`, `record` and `policy` are there from the start; `principal` once
    authenticated, `access` once the route is permitted, `upstream` once the body passed its
    checks, `admission` once the rate limits let it through. `Exchange` takes a call
    with `access`, `upstream` and `admission` set.
    """

    request: Request
    gateway: GatewayState
    record: RequestRecord  # the audit line, written once whatever happens
    policy: LoadedPolicy  # this request's policy, whatever reloads happen meanwhile
    principal: Principal | None = None
    access: Access | None = None  # what the policy lets this principal do
    upstream: Upstream | None = None
    admission: Admission | None = None  # what the limits reserved; settled when it ends

    @property
    def tenant_tag(self) -> str:
        """The opaque tag the engine serves tenants in turn by (the tenant's cache salt)."""
        return self.gateway.cache_salt(self.principal.tenant) if self.principal is not None else ""
