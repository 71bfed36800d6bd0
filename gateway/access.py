"""What a principal may do under a policy: its models, caps and rate limits, resolved once.

Resolution walks defaults -> tenant -> principal; the result is cached per policy snapshot
because the hot path asks the same question for every request of the same caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache

from gateway.auth.principal import Principal
from gateway.policy.loader import LoadedPolicy
from gateway.policy.models import Limits


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

    @property
    def any_model(self) -> bool:
        """True when no model list narrows this principal: it may leave `model` out."""
        return all(models is None or "*" in models for models in self._lists())

    def allows_model(self, model: str) -> bool:
        return all(models is None or any(fnmatchcase(model, p) for p in models) for models in self._lists())

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
    body = _tightest(*(lim.max_body_bytes for lim in both)) or 4 * 1024 * 1024
    return Access(
        tenant_models=tuple(tenant.models),
        principal_models=tuple(rule.models) if rule and rule.models is not None else None,
        key_models=_key_models(loaded, key_id),
        key_limits=key_limits,
        tenant_limits=tenant.limits,
        max_tokens=_tightest(*(lim.max_tokens for lim in both)),
        max_prompt_tokens=_tightest(*(lim.max_prompt_tokens for lim in both)),
        max_body_bytes=body,
        cache_scope=tenant.cache_scope or policy.cache_scope,
    )


def _key_models(loaded: LoadedPolicy, key_id: str | None) -> tuple[str, ...] | None:
    record = loaded.keys.get(key_id) if key_id else None
    return tuple(record.models) if record is not None and record.models is not None else None


def access_for(loaded: LoadedPolicy, principal: Principal) -> Access:
    return _resolve(loaded, principal.id, principal.tenant, principal.key_id)
