"""A copy of every audit line for a syslog server (RFC 5424), so the record also lives off the
gateway's disk: `--audit-syslog udp://host:514` or `--audit-syslog unix:///dev/log`.

Each line is one datagram, `<110>1 TIME HOST portcullis PID audit - BOM{json}`: facility 13
("log audit"), severity 6 (informational), the audit line's JSON as the message. Lines are
sent by the audit writer's thread after they reached the file, in order, never from a request.
A datagram the receiver cannot take (its buffer full, the server down) is dropped and counted,
so a slow syslog never holds up the audit file or the requests behind it; the count is the
metric portcullis_gateway_audit_syslog_dropped. With the policy's audit.log_prompts on, UDP to
another host would carry prompts in cleartext: the gateway warns (gateway.state).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import structlog

log = structlog.get_logger("portcullis.gateway.syslog")

FACILITY_LOG_AUDIT, SEVERITY_INFO = 13, 6
PRI = FACILITY_LOG_AUDIT * 8 + SEVERITY_INFO
BOM = b"\xef\xbb\xbf"  # RFC 5424: the message is UTF-8
RESOLVE_RETRY_S = 30.0


def parse_syslog_url(url: str) -> tuple[str, str | None, int | None]:
    """(scheme, host or socket path, port) of udp://host:port or unix:///path, or ValueError."""
    parts = urlsplit(url)
    if parts.scheme == "udp" and parts.hostname and parts.port and parts.path in ("", "/"):
        return "udp", parts.hostname, parts.port
    if parts.scheme == "unix" and not parts.netloc and parts.path.startswith("/"):
        return "unix", parts.path, None
    raise ValueError(f"{url!r} is not a syslog address such as udp://logs.internal:514 or unix:///dev/log")


def sends_off_host(url: str) -> bool:
    """Whether the mirror's datagrams leave the machine in cleartext: UDP to anything but a
    loopback address (a name counts as off the host: it is not resolved at start)."""
    scheme, where, _ = parse_syslog_url(url)
    if scheme == "unix" or where == "localhost":
        return False
    try:
        return not ipaddress.ip_address(where or "").is_loopback
    except ValueError:
        return True


class SyslogMirror:
    """The host is resolved at the first line, not at start, and again at most every
    RESOLVE_RETRY_S while it fails: a syslog name that DNS does not know yet (a cluster coming
    up) must not stop the gateway, and a lookup must not hold up the audit writer each line."""

    def __init__(self, url: str, on_drop: Callable[[], None] | None = None) -> None:
        self.scheme, self.where, self.port = parse_syslog_url(url)
        self.url, self.on_drop = url, on_drop
        self.sock: socket.socket | None = None
        self.address: Any = None
        self._next_resolve = 0.0
        self._unresolved: OSError | None = None
        self.host = (socket.gethostname() or "-")[:255]
        self.dropped = 0

    def send(self, lines: list[bytes]) -> None:
        """Called by the audit writer with the lines it wrote, in order."""
        if not self._connect():
            for _ in lines:
                self._drop(self._unresolved or OSError("not resolved yet"))
            return
        for line in lines:
            try:
                self.sock.sendto(self.frame(line), self.address)  # type: ignore[union-attr]
            except OSError as exc:  # full buffer, nobody listening, a datagram too large
                self._drop(exc)

    def _connect(self) -> bool:
        if self.sock is not None:
            return True
        now = time.monotonic()
        if now < self._next_resolve:
            return False
        self._next_resolve = now + RESOLVE_RETRY_S
        try:
            family, address = self._resolve()
        except OSError as exc:  # socket.gaierror: unknown name, no DNS
            self._unresolved = OSError(f"cannot resolve {self.where}: {exc}")
            return False
        self.sock, self.address = socket.socket(family, socket.SOCK_DGRAM), address
        self.sock.setblocking(False)
        return True

    def _resolve(self) -> tuple[socket.AddressFamily, Any]:
        if self.scheme == "unix":
            return socket.AF_UNIX, self.where
        family, _, _, _, address = socket.getaddrinfo(self.where, self.port, type=socket.SOCK_DGRAM)[0]
        return family, address

    def frame(self, line: bytes) -> bytes:
        stamp = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        head = f"<{PRI}>1 {stamp} {self.host} portcullis {os.getpid()} audit - "
        return head.encode("ascii", "replace") + BOM + line.rstrip(b"\n")

    def _drop(self, exc: OSError) -> None:
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop()
        if self.dropped == 1 or self.dropped % 1000 == 0:  # a dead server must not flood the log
            log.warning("audit_syslog_dropped", syslog=self.url, dropped=self.dropped, error=str(exc),
                        hint="the audit file has every line; check the syslog server")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
