"""The audit trail: writing the hash-chained log, and reading it back for reviewers."""

from gateway.audit.log import AuditLog

__all__ = ["AuditLog"]
