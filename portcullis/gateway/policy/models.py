"""The policy as pydantic models: the single source of truth for the YAML schema.

`policies/schema.json` is generated from `Policy` (see `gateway.policy.schema`), so the file an
admin edits, the JSON Schema an editor validates against and the gateway all agree. Every
model forbids unknown fields: a misspelt limit must fail loudly, not silently do nothing.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from portcullis.gateway.settings import check_engine_url

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$"
KEY_ID_PATTERN = r"^[a-z0-9]{8,32}$"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
OPERATOR_ROUTES = frozenset({"/metrics"})


class PolicyProblem(ValueError):
    """A cross-field problem that knows where it lives (`loc`, as in a pydantic error), so the
    loader can point at the offending line rather than at the top of the file."""

    def __init__(self, message: str, loc: tuple[str | int, ...]) -> None:
        super().__init__(message)
        self.loc = loc


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def utc_period(name: str, moment: datetime) -> tuple[datetime, datetime]:
    """The UTC calendar day or month (`name`) holding `moment`, as [start, end): the periods
    budgets count in, and `audit usage --period` sums over."""
    start = moment.astimezone(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    if name == "day":
        return start, start + timedelta(days=1)
    start = start.replace(day=1)
    return start, (start + timedelta(days=32)).replace(day=1)


class Budgets(Strict):
    """Totals over UTC calendar periods: a day ends at 00:00 UTC, a month on the 1st at 00:00
    UTC, and the count starts again from zero. `None` means no budget."""

    tokens_per_day: int | None = Field(None, ge=1, description="prompt + completion tokens per UTC day")
    tokens_per_month: int | None = Field(None, ge=1, description="prompt + completion tokens per UTC month")
    requests_per_day: int | None = Field(None, ge=1)
    requests_per_month: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _day_fits_in_month(self) -> Budgets:
        # A day budget above the month's could never be used up: almost surely a typo.
        for unit in ("tokens", "requests"):
            day, month = getattr(self, f"{unit}_per_day"), getattr(self, f"{unit}_per_month")
            if day is not None and month is not None and day > month:
                raise ValueError(f"{unit}_per_day ({day}) is larger than {unit}_per_month ({month}); "
                                 "a day's budget must fit in the month's")
        return self

    def merged_over(self, base: Budgets | None) -> Budgets:
        return self if base is None else base.model_copy(update=self.model_dump(exclude_none=True))


class Limits(Strict):
    """Caps for one scope (a whole tenant, or each key of it). `None` means no cap."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt + completion tokens")
    concurrent_requests: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="cap on max_tokens per request")
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_body_bytes: int | None = Field(None, ge=1024, le=64 * 1024 * 1024)
    # Fan-out caps: unset means the gateway's safe default, not "no cap" (see gateway.access).
    max_n: int | None = Field(None, ge=1, le=1024, description="most choices (n) per request; default 16")
    max_prompts_per_request: int | None = Field(
        None, ge=1, le=4096,
        description="most prompts in one /v1/completions request, or inputs in one /v1/embeddings request; default 16")
    max_logprobs: int | None = Field(
        None, ge=0, le=1024, description="most logprobs / top_logprobs / prompt_logprobs; default 20")
    max_response_bytes: int | None = Field(
        None, ge=1024, le=1024 * 1024 * 1024, description="largest non-streamed response; default 8 MiB")
    budgets: Budgets | None = Field(None, description="token and request totals per UTC day and month")

    def merged_over(self, base: Limits) -> Limits:
        """This scope's values where set, the base's elsewhere (budget by budget)."""
        ours = self.model_dump(exclude_none=True, exclude={"budgets"})
        budgets = base.budgets if self.budgets is None else self.budgets.merged_over(base.budgets)
        return base.model_copy(update={**ours, "budgets": budgets})


class Route(Strict):
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"]
    path: str = Field(description="canonical lower-case path: /v1/chat/completions, /v1/completions, "
                      "/v1/messages, /v1/messages/count_tokens, /v1/responses, /v1/embeddings, "
                      "/v1/models, /tokenize, ...")
    scopes: list[str] = Field(
        default_factory=list, description="if set, the principal needs one of these scopes"
    )

    @field_validator("path")
    @classmethod
    def _canonical(cls, path: str) -> str:
        # Listed paths must already be in the normal form requests are reduced to; otherwise
        # an entry could never match, or worse, match something the admin did not mean.
        if not re.fullmatch(r"(/[a-z0-9_.-]+)+|/", path) or "/./" in path or ".." in path:
            raise ValueError(f"route path {path!r} must be lower-case, absolute, without '..', '//' or a trailing '/'")
        return path

    @model_validator(mode="after")
    def _operator_routes_need_scopes(self) -> Route:
        # The engine's metrics describe every tenant's traffic: never open to plain users.
        if self.path in OPERATOR_ROUTES and not self.scopes:
            raise ValueError(f"{self.path} exposes the engine's internals; list it with scopes (e.g. [admin])")
        return self


PRIORITY_DESCRIPTION = (
    "scheduling priority sent to the engine (lower runs first, as vLLM's; the engine needs "
    "--scheduling-policy priority): a request's priority is raised to this, a client may only ask "
    "for a larger number; unset leaves the client's as sent")


class Tenant(Strict):
    models: list[str] = Field(default_factory=lambda: ["*"], description="model names, '*' = any")
    limits: Limits = Field(default_factory=Limits, description="shared by the whole tenant")
    key_limits: Limits = Field(default_factory=Limits, description="applied to each key/principal")
    cache_scope: Literal["tenant", "global"] | None = None
    priority: int | None = Field(None, ge=-(2**31), lt=2**31, description=PRIORITY_DESCRIPTION)


class PrincipalRule(Strict):
    """Optional per-principal narrowing; keys and JWT subjects resolve to these ids."""

    tenant: str
    scopes: list[str] = Field(default_factory=list)
    models: list[str] | None = None
    limits: Limits = Field(default_factory=Limits)
    priority: int | None = Field(None, ge=-(2**31), lt=2**31,
                                 description="overrides the tenant's priority for this principal's keys and tokens")


class KeyRecord(Strict):
    """An API key as stored: only a salted hash of the secret, never the secret itself."""

    id: str = Field(pattern=KEY_ID_PATTERN)
    principal: str = Field(pattern=ID_PATTERN)
    tenant: str = Field(pattern=ID_PATTERN)
    scopes: list[str] = Field(default_factory=list)
    models: list[str] | None = Field(None, description="narrows the principal's models for this key")
    hash: str = Field(pattern=r"^hmac-sha256\$[A-Za-z0-9_-]{16,}\$[A-Za-z0-9_-]{43}$")
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    replaced_by: str | None = Field(None, description="id of the key this one was rotated to")
    note: str = ""

    @field_validator("created_at", "expires_at", "revoked_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


class ClaimMap(Strict):
    principal: str = "sub"
    tenant: str = "tenant"
    scopes: str = "scope"


class JwtSettings(Strict):
    algorithms: list[Literal["RS256", "ES256", "HS256"]] = Field(min_length=1)
    issuer: str
    audience: str
    jwks_file: str | None = None
    jwks_url: str | None = None
    hs256_secret_env: str | None = Field(None, description="env var holding the HS256 secret")
    leeway_seconds: int = Field(30, ge=0, le=300)
    claims: ClaimMap = Field(default_factory=ClaimMap)
    default_tenant: str | None = None
    jwks_refresh_min_seconds: float = Field(30.0, ge=0, description="floor between refetches")

    @model_validator(mode="after")
    def _keys_for_algorithms(self) -> JwtSettings:
        wants_asym = any(a != "HS256" for a in self.algorithms)
        if wants_asym and not (self.jwks_file or self.jwks_url):
            raise ValueError("RS256/ES256 need jwks_file or jwks_url")
        if "HS256" in self.algorithms and not self.hs256_secret_env:
            raise ValueError("HS256 needs hs256_secret_env (the secret never lives in the policy)")
        if self.jwks_url and not self.jwks_url.startswith("https://"):
            raise ValueError("jwks_url must be https://")
        return self


class RateLimitSettings(Strict):
    storage: str = Field("memory://", description="memory:// or redis://host:port/db")
    auth_failures_per_minute: int = Field(20, ge=1, description="per client address")
    key_prefix: str = Field("portcullis", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    on_storage_error: Literal["refuse", "allow"] = Field(
        "refuse", description="when the storage (Redis) fails: refuse requests (503) or serve them unlimited")

    @field_validator("storage")
    @classmethod
    def _scheme(cls, uri: str) -> str:
        if not re.match(r"^(memory://|rediss?://|redis\+unix://)", uri):
            raise ValueError("storage must be memory://, redis://, rediss:// or redis+unix://")
        return uri


class AuditSettings(Strict):
    path: str = "audit.log"
    max_bytes: int = Field(100 * 1024 * 1024, ge=4096)
    backups: int = Field(10, ge=1, le=1000)
    log_prompts: bool = Field(False, description="also store the prompt text (up to 32 KiB of JSON; "
                              "prompt_hmac always fingerprints all of it)")
    on_failure: Literal["refuse", "serve"] = Field(
        "refuse", description="when audit lines cannot be written (disk full, I/O error): refuse "
        "requests with 503 until they can, or serve them unaudited")


class MetricsSettings(Strict):
    path: str = "/gateway/metrics"
    scope: str | None = Field("admin", description="scope needed to read; null = open")


class ConsoleSettings(Strict):
    path: str = Field("/gateway/console", pattern=r"^(/[A-Za-z0-9._~-]+)+$",
                      description="where the console's JSON API (and pages) are served")
    scope: str = Field("admin", min_length=1, description="scope a principal needs to see anything of it; "
                       "the console is never open")
    write_scope: str | None = Field(None, min_length=1, description="scope that may also revoke keys of the "
                                    "keys_file from the console, each revocation audited; unset: read-only")


class UpstreamRule(Strict):
    """One engine replica behind the gateway: where it listens and which models it serves.

    Replicas listing the same model form that model's group; the gateway balances inside it.
    """

    name: str = Field(pattern=ID_PATTERN, description="names the replica in audit lines and metrics")
    url: str = Field(description="unix:///path/to/engine.sock or http://private-host:port")
    token_file: str | None = Field(
        None, description="file with this engine's internal token, relative to the policy; "
        "unset = the gateway's own engine token")
    models: list[str] = Field(min_length=1, description="model names it serves (checked against its /v1/models)")
    weight: float = Field(1.0, gt=0, le=1000, description="relative capacity: load is divided by it")

    @field_validator("url")
    @classmethod
    def _private(cls, url: str) -> str:
        return check_engine_url(url)


class Policy(Strict):
    version: Literal[1] = 1
    routes: list[Route] = Field(min_length=1)
    tenants: dict[str, Tenant] = Field(min_length=1)
    principals: dict[str, PrincipalRule] = Field(default_factory=dict)
    keys_file: str | None = Field(None, description="CLI-managed keys file, relative to the policy")
    keys: list[KeyRecord] = Field(default_factory=list)
    jwt: JwtSettings | None = None
    client_certs: dict[str, str] = Field(
        default_factory=dict, description="mTLS: a verified client certificate's name (DNS, URI or email "
        "subject alternative name, or subject CN) -> a principal listed under principals:")
    defaults: Limits = Field(
        default_factory=lambda: Limits(max_body_bytes=4 * 1024 * 1024),
        description="limits for every scope that does not set its own",
    )
    hide_unknown_models: bool = Field(False, description="refused model -> 404 instead of 403")
    max_tokens_over_cap: Literal["reject", "clamp"] = "reject"
    cache_scope: Literal["tenant", "global"] = "tenant"
    rate_limits: RateLimitSettings = Field(default_factory=RateLimitSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    upstreams: list[UpstreamRule] = Field(
        default_factory=list, description="the engines behind the gateway; empty = the one engine of "
        "--engine-url, serving every model")
    upstream_strategy: Literal["prefix", "least_load", "round_robin"] = Field(
        "prefix", description="how a replica is picked inside a model's group: prefix affinity with a "
        "bounded load (default), the least loaded, or in turn")

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        _check_unique_routes(self.routes)
        _check_tenants_exist(self)
        _check_unique_upstreams(self.upstreams)
        _check_day_budgets_fit_inherited_months(self)
        return self


def _check_day_budgets_fit_inherited_months(policy: Policy) -> None:
    """A key's day budget above a month budget it is also under (its own month, inherited from
    the tenant's key_limits or the defaults, or its tenant's month) could never be used up:
    almost surely a typo, refused like a day above the month in one budgets block."""
    for name, tenant in policy.tenants.items():
        key_limits = tenant.key_limits.merged_over(policy.defaults)
        scopes = [(f"tenants.{name}.key_limits", key_limits)] + [
            (f"principals.{who}.limits", rule.limits.merged_over(key_limits))
            for who, rule in policy.principals.items() if rule.tenant == name]
        for path, limits in scopes:
            months = [("that applies to it", limits.budgets), (f"of tenants.{name}.limits", tenant.limits.budgets)]
            for unit in ("tokens", "requests"):
                day = getattr(limits.budgets, f"{unit}_per_day", None)
                for where, budgets in months:
                    month = getattr(budgets, f"{unit}_per_month", None)
                    if day is not None and month is not None and day > month:
                        raise ValueError(f"{path}.budgets.{unit}_per_day ({day}) is larger than the "
                                         f"{unit}_per_month ({month}) {where}; a day's budget must fit in the month's")


def budgets_set(policy: Policy) -> list[str]:
    """Where the policy sets budgets, by field path."""
    scopes = [("defaults", policy.defaults)]
    for name, tenant in policy.tenants.items():
        scopes += [(f"tenants.{name}.limits", tenant.limits), (f"tenants.{name}.key_limits", tenant.key_limits)]
    scopes += [(f"principals.{name}.limits", rule.limits) for name, rule in policy.principals.items()]
    return [f"{path}.budgets" for path, limits in scopes
            if limits.budgets is not None and limits.budgets.model_dump(exclude_none=True)]


def memory_budgets_warning(policy: Policy) -> str | None:
    """Budgets kept in process memory are not what an admin setting a month's budget expects."""
    where = budgets_set(policy) if policy.rate_limits.storage.startswith("memory://") else []
    if not where:
        return None
    return (f"budgets ({', '.join(where)}) are counted in each gateway process's memory "
            "(rate_limits.storage memory://): they start again from zero at every restart, and each "
            "--workers worker allows the whole budget; set rate_limits.storage to a redis:// URL to keep "
            "and share them")


def _check_unique_upstreams(upstreams: list[UpstreamRule]) -> None:
    names: dict[str, int] = {}
    urls: dict[str, int] = {}
    for index, rule in enumerate(upstreams):
        if rule.name in names:
            raise PolicyProblem(f"upstream name {rule.name!r} is already used by upstreams.{names[rule.name]}",
                                ("upstreams", index, "name"))
        if rule.url in urls:
            raise PolicyProblem(f"upstream url {rule.url!r} is already listed as upstreams.{urls[rule.url]}",
                                ("upstreams", index, "url"))
        names[rule.name], urls[rule.url] = index, index


def _check_unique_routes(routes: list[Route]) -> None:
    seen: dict[tuple[str, str], int] = {}
    for index, route in enumerate(routes):
        pair = (route.method, route.path)
        if pair in seen:
            raise PolicyProblem(f"route {route.method} {route.path} is already listed as routes.{seen[pair]}; "
                                "remove one of them", ("routes", index))
        seen[pair] = index


def _unknown_tenant(tenant: str, policy: Policy) -> str:
    return (f"tenant {tenant!r} is not defined under tenants: (defined: {', '.join(policy.tenants)}); "
            "add it there or fix the name")


def _check_tenants_exist(policy: Policy) -> None:
    for name, rule in policy.principals.items():
        if rule.tenant not in policy.tenants:
            raise PolicyProblem(_unknown_tenant(rule.tenant, policy), ("principals", name, "tenant"))
    if policy.jwt and policy.jwt.default_tenant and policy.jwt.default_tenant not in policy.tenants:
        raise PolicyProblem(_unknown_tenant(policy.jwt.default_tenant, policy), ("jwt", "default_tenant"))
    for name, principal in policy.client_certs.items():
        if principal not in policy.principals:  # its tenant and scopes come from there
            raise PolicyProblem(f"client certificate {name!r} maps to {principal!r}, which is not listed under "
                                "principals: (add it there with its tenant)", ("client_certs", name))


class KeysFile(Strict):
    """The CLI-managed file: only key records, so the CLI never rewrites the admin's YAML."""

    version: Literal[1] = 1
    keys: list[KeyRecord] = Field(default_factory=list)
