"""`GatewayState`: the long-lived parts one gateway process shares across requests.

Policy-dependent parts (the rate-limit storage, the audit file) are rebuilt when a reload
changes their settings; requests already admitted keep the objects they started with.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import structlog

from portcullis.gateway.audit import AuditLog
from portcullis.gateway.audit.keys import AuditKeyring, KeyringError, check_outside, keyring_path
from portcullis.gateway.auth.tokens import JwksCache
from portcullis.gateway.body import PromptAudit
from portcullis.gateway.metrics import GatewayMetrics
from portcullis.gateway.policy.loader import LoadedPolicy, PolicyError, resolve_relative
from portcullis.gateway.policy.models import KeyRecord
from portcullis.gateway.policy.store import PolicyStore
from portcullis.gateway.ratelimit import FailedAuthLimiter, RateLimiter
from portcullis.gateway.settings import GatewaySettings
from portcullis.gateway.syslog import SyslogMirror, sends_off_host
from portcullis.gateway.upstream.fleet import Fleet

log = structlog.get_logger("portcullis.gateway.state")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class GatewayState:
    settings: GatewaySettings
    store: PolicyStore
    fleet: Fleet
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    jwks: JwksCache = field(default_factory=JwksCache)
    auth_failures: FailedAuthLimiter = field(default_factory=FailedAuthLimiter)
    clock: Callable[[], datetime] = _utcnow
    limiter: RateLimiter = field(init=False)
    audit: AuditLog = field(init=False)
    keyring: AuditKeyring = field(init=False)
    audit_syslog: SyslogMirror | None = field(init=False)
    _salt_key: bytes = field(init=False, repr=False)
    _retired: list[RateLimiter] = field(default_factory=list, repr=False)
    _keys_seen: dict[str, KeyRecord] = field(default_factory=dict, repr=False)  # the keys of the policy in force

    def __post_init__(self) -> None:
        token = self.settings.engine_token.get_secret_value().encode()
        # Derived from the internal token, so every worker and replica agrees on the salt
        # without one more secret to distribute, and clients can never compute it.
        self._salt_key = hmac.new(token, b"portcullis cache salt v1", hashlib.sha256).digest()
        self._configure_fleet(self.store.current, at_start=True)
        self._keys_seen = dict(self.store.current.keys)
        self.limiter = self._new_limiter(self.store.current)
        self.keyring = AuditKeyring.load_or_create(keyring_path(self.settings.audit_keyring, self.settings.policy))
        check_outside(self.keyring.path, self._audit_path(self.store.current))  # type: ignore[arg-type]
        self.audit_syslog = self._syslog_mirror()
        self._warn_prompts_off_host(self.store.current)
        self.audit = self._new_audit(self.store.current)
        self.audit.write(event="gateway_start", pid=os.getpid(), **self._policy_fields(self.store.current))
        self.store.on_change(self._policy_changed)
        self.store.on_refused(self._policy_refused)
        self.metrics.watch_policy(self.store)
        self.metrics.watch_fleet(self.fleet)

    def _syslog_mirror(self) -> SyslogMirror | None:
        url = self.settings.audit_syslog
        return SyslogMirror(url, on_drop=self.metrics.audit_syslog_dropped.inc) if url else None

    def _warn_prompts_off_host(self, loaded: LoadedPolicy) -> None:
        """Prompts in audit lines would cross the network in cleartext UDP: say so, at start and
        at each policy that logs them (a refusal would stop a running gateway at a reload)."""
        url = self.settings.audit_syslog
        if url and loaded.policy.audit.log_prompts and sends_off_host(url):
            log.warning("audit_prompts_leave_host_in_cleartext", syslog=url,
                        hint="audit.log_prompts is on and --audit-syslog sends UDP off this host: "
                        "mirror to a local relay (unix:///dev/log, udp://127.0.0.1) that forwards "
                        "over TLS, or turn log_prompts off")

    def _new_limiter(self, loaded: LoadedPolicy) -> RateLimiter:
        settings = loaded.policy.rate_limits
        return RateLimiter(settings.storage, settings.key_prefix)

    def _audit_path(self, loaded: LoadedPolicy) -> Path:
        return resolve_relative(loaded.path, loaded.policy.audit.path)

    def _new_audit(self, loaded: LoadedPolicy) -> AuditLog:
        audit, s = loaded.policy.audit, self.settings
        return AuditLog(self._audit_path(loaded), audit.max_bytes, audit.backups, keyring=self.keyring,
                        checkpoint_lines=s.audit_checkpoint_lines, checkpoint_interval_s=s.audit_checkpoint_interval_s,
                        mirror=self.audit_syslog.send if self.audit_syslog else None)

    def _configure_fleet(self, loaded: LoadedPolicy, at_start: bool = False) -> None:
        try:
            self.fleet.configure(loaded.policy.upstreams, loaded.path, loaded.policy.upstream_strategy)
        except OSError as exc:  # an upstream's token file: the replicas in force keep serving
            if at_start:
                raise ValueError(f"cannot read an upstream's token_file: {exc}") from None
            log.error("upstreams_not_applied", error=str(exc), hint="fix the upstream's token_file")

    def _policy_fields(self, loaded: LoadedPolicy) -> dict[str, object]:
        """The policy file's SHA-256 as read (and its keys file's), and the generation it is (or
        would have been)."""
        digest = next((r.digest for r in loaded.reads if r.path == self.store.path), None)
        keys = next((r.digest for r in loaded.reads if r.path != self.store.path and r.digest), None)
        fields: dict[str, object] = {"policy_sha256": digest, "policy_generation": self.store.generation}
        return {**fields, "keys_sha256": keys} if keys else fields

    def _policy_refused(self, exc: PolicyError) -> None:
        digest = next((r.digest for r in exc.reads if r.path == self.store.path and r.digest), None)
        self.audit.write(event="policy_reload", outcome="refused", error=str(exc), policy_sha256=digest,
                         policy_generation=self.store.generation)  # the one still in force

    def _policy_changed(self, loaded: LoadedPolicy) -> None:
        # Which keys the reload added, removed, revoked or re-dated: however the keys file was
        # changed (`portcullis keys`, an editor, a Secret update), the gateway audits the effect.
        changes, self._keys_seen = key_changes(self._keys_seen, loaded.keys), dict(loaded.keys)
        self.audit.write(event="policy_reload", outcome="applied", **self._policy_fields(loaded), **changes)
        self.metrics.policy_reloads.labels("applied").inc()
        self._warn_prompts_off_host(loaded)
        self._configure_fleet(loaded)
        rl = loaded.policy.rate_limits
        if (rl.storage, rl.key_prefix) != (self.limiter.uri, self.limiter.prefix):
            # Requests in flight settle with the limiter that admitted them; close it at exit.
            self._retired.append(self.limiter)
            self.limiter = self._new_limiter(loaded)
        audit = loaded.policy.audit
        if (self._audit_path(loaded), audit.max_bytes, audit.backups) != (
            self.audit.path, self.audit.file.max_bytes, self.audit.file.backups,
        ):
            try:
                check_outside(self.keyring.path, self._audit_path(loaded))  # type: ignore[arg-type]
            except KeyringError as exc:
                log.error("audit_path_not_applied", error=str(exc))
                return
            # The old writer finishes its queue first, so no line of the new log can be chained
            # before one submitted earlier (a rare wait on the loop: only on this reload).
            self.audit.close()
            self.audit = self._new_audit(loaded)

    async def refusing_unaudited(self) -> bool:
        """Whether requests are refused now because the audit log cannot be written."""
        return not await self.audit.writable() and self.store.current.policy.audit.on_failure == "refuse"

    def prompt_audit(self, log_prompts: bool) -> PromptAudit:
        """How request lines fingerprint (and, if the policy says, log) prompts."""
        return PromptAudit(self.keyring.fingerprint, log_prompts)

    def cache_salt(self, tenant: str) -> str:
        return _salt(self._salt_key, tenant)

    async def close(self) -> None:
        for limiter in [*self._retired, self.limiter]:
            await limiter.close()
        await self.fleet.close()
        self.audit.write(event="gateway_stop", pid=os.getpid(), policy_generation=self.store.generation)
        self.audit.close()  # returns once its writer has written every queued line


@lru_cache(maxsize=1024)
def _salt(key: bytes, tenant: str) -> str:
    return hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()


def key_changes(before: dict[str, KeyRecord], after: dict[str, KeyRecord]) -> dict[str, list[str]]:
    """Key ids a reload added, removed, revoked, or gave a new expiry (a rotation's overlap), as
    audit fields; only the kinds that happened."""
    changes = {
        "keys_added": sorted(after.keys() - before.keys()),
        "keys_removed": sorted(before.keys() - after.keys()),
        "keys_revoked": sorted(k for k in after.keys() & before.keys()
                               if after[k].revoked_at and not before[k].revoked_at),
        "keys_expiry_changed": sorted(k for k in after.keys() & before.keys()
                                      if after[k].expires_at != before[k].expires_at),
    }
    return {name: ids for name, ids in changes.items() if ids}
