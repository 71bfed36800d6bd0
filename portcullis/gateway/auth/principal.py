"""Who is calling: the principal every check after authentication works from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Principal:
    id: str
    tenant: str
    scopes: frozenset[str] = field(default_factory=frozenset)
    key_id: str | None = None
    method: str = "api_key"

    @property
    def limit_id(self) -> str:
        """The identity per-key limits count against: the key, or the JWT subject within its
        tenant (an IdP may issue one `sub` for several tenants; each is its own caller)."""
        return f"key:{self.key_id}" if self.key_id else f"sub:{self.tenant}/{self.id}"  # "/" is in no tenant name
