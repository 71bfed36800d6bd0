"""What a principal may do under a policy: its models, caps and rate limits, resolved once.

Resolution walks defaults -> tenant -> principal; the result is cached per policy snapshot
because the hot path asks the same question for every request of the same caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache

from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.policy.loader import LoadedPolicy
from portcullis.gateway.policy.models import Limits, PrincipalRule
from portcullis.protocol.caps import MAX_LOGPROBS

# What an unset fan-out cap means. One request's cost grows with n x prompts (x logprobs for
# its size), so "no cap" would let a single caller fill the engine's shared queue.
DEFAULT_MAX_N = 16
DEFAULT_MAX_PROMPTS = 16
DEFAULT_MAX_LOGPROBS = MAX_LOGPROBS  # the engine's own cap
DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Access:
    tenant_models: tuple[str, ...]
    principal_models: tuple[str, ...] | None
    key_models: tuple[str, ...] | None
    key_limits: Limits
    tenant_limits: Limits
    max_tokens: int | None
    max_prompt_tokens: int | None
    max_body_bytes: int
    cache_scope: str
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    tenant: str = ""
    priority: int | None = None  # the engine priority this principal's requests get at least
    # Per-key limit -> the policy field it came from, so a 429 can say what to raise.
    key_limit_fields: tuple[tuple[str, str], ...] = ()

    @property
    def any_model(self) -> bool:
        """True when no model list narrows this principal: it may leave `model` out."""
        return all(models is None or "*" in models for models in self._lists())

    def allows_model(self, model: str) -> bool:
        return all(models is None or any(fnmatchcase(model, p) for p in models) for models in self._lists())

    def limit_field(self, scope: str, name: str) -> str:
        """The policy path an admin edits to raise limit `name` of `scope` ("key" or "tenant");
        a budget is named by its path, `budgets.tokens_per_day`."""
        if scope == "tenant":
            return f"tenants.{self.tenant}.limits.{name}"
        return dict(self.key_limit_fields).get(name, f"defaults.{name}")

    def cap_field(self, name: str) -> str:
        """The policy path that sets cap `name` (max_tokens, max_n, ...) for this principal: the
        tighter of its tenant's and its keys' (or `defaults`, when neither sets it)."""
        tenant, key = getattr(self.tenant_limits, name), getattr(self.key_limits, name)
        if tenant is not None and (key is None or tenant <= key):
            return self.limit_field("tenant", name)
        return self.limit_field("key", name)

    def _lists(self) -> tuple[tuple[str, ...] | None, ...]:
        # Each level can only narrow the one above: tenant, then principal, then the key.
        return (self.tenant_models, self.principal_models, self.key_models)


def _tightest(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


@lru_cache(maxsize=4096)
def _resolve(loaded: LoadedPolicy, principal_id: str, tenant_name: str, key_id: str | None) -> Access:
    policy = loaded.policy
    tenant = policy.tenants[tenant_name]
    rule = policy.principals.get(principal_id)
    key_limits = tenant.key_limits.merged_over(policy.defaults)
    if rule is not None:
        key_limits = rule.limits.merged_over(key_limits)
    both = (key_limits, tenant.limits)

    def cap(name: str, default: int) -> int:
        found = _tightest(*(getattr(lim, name) for lim in both))
        return default if found is None else found

    return Access(
        tenant_models=tuple(tenant.models),
        principal_models=tuple(rule.models) if rule and rule.models is not None else None,
        key_models=_key_models(loaded, key_id),
        key_limits=key_limits,
        tenant_limits=tenant.limits,
        max_tokens=_tightest(*(lim.max_tokens for lim in both)),
        max_prompt_tokens=_tightest(*(lim.max_prompt_tokens for lim in both)),
        max_body_bytes=cap("max_body_bytes", DEFAULT_MAX_BODY_BYTES),
        cache_scope=tenant.cache_scope or policy.cache_scope,
        max_n=cap("max_n", DEFAULT_MAX_N),
        max_prompts=cap("max_prompts_per_request", DEFAULT_MAX_PROMPTS),
        max_logprobs=cap("max_logprobs", DEFAULT_MAX_LOGPROBS),
        max_response_bytes=cap("max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES),
        tenant=tenant_name,
        priority=rule.priority if rule is not None and rule.priority is not None else tenant.priority,
        key_limit_fields=_key_limit_fields(tenant_name, tenant.key_limits, principal_id, rule),
    )


def _key_limit_fields(
    tenant_name: str, tenant_keys: Limits, principal_id: str, rule: PrincipalRule | None
) -> tuple[tuple[str, str], ...]:
    """Where each per-key limit is set: the principal's rule, then the tenant's key_limits;
    anything else comes from `defaults`."""
    found = {name: f"tenants.{tenant_name}.key_limits.{name}" for name in _set(tenant_keys)}
    if rule is not None:
        found.update({name: f"principals.{principal_id}.limits.{name}" for name in _set(rule.limits)})
    return tuple(sorted(found.items()))


def _set(limits: Limits) -> list[str]:
    """The limits this scope sets itself; budgets by their path (`budgets.tokens_per_day`)."""
    names = [name for name in limits.model_fields_set - {"budgets"} if getattr(limits, name) is not None]
    budgets = limits.budgets
    if budgets is None:
        return names
    return names + [f"budgets.{name}" for name in budgets.model_fields_set if getattr(budgets, name) is not None]


def _key_models(loaded: LoadedPolicy, key_id: str | None) -> tuple[str, ...] | None:
    record = loaded.keys.get(key_id) if key_id else None
    return tuple(record.models) if record is not None and record.models is not None else None


def access_for(loaded: LoadedPolicy, principal: Principal) -> Access:
    return _resolve(loaded, principal.id, principal.tenant, principal.key_id)
