"""The audit trail: the record each request fills in, the hash-chained log its writer thread
appends to, and reading the log back for reviewers."""

from portcullis.gateway.audit.log import AuditLog

__all__ = ["AuditLog"]
