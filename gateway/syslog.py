"""A copy of every audit line for a syslog server (RFC 5424), so the record also lives off the
gateway's disk: `--audit-syslog udp://host:514` or `--audit-syslog unix:///dev/log`.

Each line is one datagram, `<110>1 TIME HOST portcullis PID audit - BOM{json}`: facility 13
("log audit"), severity 6 (informational), the audit line's JSON as the message. Lines are
sent by the audit writer's thread after they reached the file, in order, never from a request.
A datagram the receiver cannot take (its buffer full, the server down) is dropped and counted,
so a slow syslog never holds up the audit file or the requests behind it.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from urllib.parse import urlsplit

import structlog

log = structlog.get_logger("gateway.syslog")

FACILITY_LOG_AUDIT, SEVERITY_INFO = 13, 6
PRI = FACILITY_LOG_AUDIT * 8 + SEVERITY_INFO
BOM = b"\xef\xbb\xbf"  # RFC 5424: the message is UTF-8


def parse_syslog_url(url: str) -> tuple[str, str | None, int | None]:
    """(scheme, host or socket path, port) of udp://host:port or unix:///path, or ValueError."""
    parts = urlsplit(url)
    if parts.scheme == "udp" and parts.hostname and parts.port and parts.path in ("", "/"):
        return "udp", parts.hostname, parts.port
    if parts.scheme == "unix" and not parts.netloc and parts.path.startswith("/"):
        return "unix", parts.path, None
    raise ValueError(f"{url!r} is not a syslog address such as udp://logs.internal:514 or unix:///dev/log")


class SyslogMirror:
    def __init__(self, url: str) -> None:
        scheme, where, port = parse_syslog_url(url)
        if scheme == "unix":
            family, self.address = socket.AF_UNIX, where
        else:
            family, _, _, _, self.address = socket.getaddrinfo(where, port, type=socket.SOCK_DGRAM)[0]
        self.url = url
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.host = (socket.gethostname() or "-")[:255]
        self.dropped = 0

    def send(self, lines: list[bytes]) -> None:
        """Called by the audit writer with the lines it wrote, in order."""
        for line in lines:
            try:
                self.sock.sendto(self.frame(line), self.address)
            except OSError as exc:  # full buffer, nobody listening, a datagram too large
                self._drop(exc)

    def frame(self, line: bytes) -> bytes:
        stamp = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        head = f"<{PRI}>1 {stamp} {self.host} portcullis {os.getpid()} audit - "
        return head.encode("ascii", "replace") + BOM + line.rstrip(b"\n")

    def _drop(self, exc: OSError) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:  # a dead server must not flood the log
            log.warning("audit_syslog_dropped", syslog=self.url, dropped=self.dropped, error=str(exc),
                        hint="the audit file has every line; check the syslog server")

    def close(self) -> None:
        self.sock.close()
