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
    key_limits: Limits
    tenant_limits: Limits
    max_tokens: int | None
    max_prompt_tokens: int | None
    max_body_bytes: int
    cache_scope: str

    @property
    def any_model(self) -> bool:
        """True when no model list narrows this principal: it may leave `model` out."""
        return "*" in self.tenant_models and (
            self.principal_models is None or "*" in self.principal_models
        )

    def allows_model(self, model: str) -> bool:
        if not any(fnmatchcase(model, pattern) for pattern in self.tenant_models):
            return False
        if self.principal_models is None:
            return True
        return any(fnmatchcase(model, pattern) for pattern in self.principal_models)


def _tightest(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


@lru_cache(maxsize=4096)
def _resolve(loaded: LoadedPolicy, principal_id: str, tenant_name: str) -> Access:
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
        key_limits=key_limits,
        tenant_limits=tenant.limits,
        max_tokens=_tightest(*(lim.max_tokens for lim in both)),
        max_prompt_tokens=_tightest(*(lim.max_prompt_tokens for lim in both)),
        max_body_bytes=body,
        cache_scope=tenant.cache_scope or policy.cache_scope,
    )


def access_for(loaded: LoadedPolicy, principal: Principal) -> Access:
    return _resolve(loaded, principal.id, principal.tenant)
