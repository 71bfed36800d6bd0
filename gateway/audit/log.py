"""`AuditLog`: one hash-chained JSON line per request, flushed, size-rotated.

Each line carries `seq` and `prev` (the SHA-256 of the previous line's bytes), so editing,
removing or reordering any line breaks the chain that `portcullis audit verify` walks.
Several gateway worker processes share one file and one chain: every append happens under
an exclusive lock, and a writer that sees the file grew (or was rotated) since its own last
append re-reads the tail before chaining onto it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import structlog

GENESIS = "0" * 64
TAIL_READ = 64 * 1024


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def rotated_name(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def last_line(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - TAIL_READ))
            lines = handle.read().rstrip(b"\n").split(b"\n")
    except FileNotFoundError:
        return None
    return lines[-1] if lines and lines[-1] else None


class ChainedFile:
    """The structlog 'logger': appends one chained line per call, across processes."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lockfile = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        self._fd: int | None = None
        self._ino = -1
        self._end = -1
        self._prev, self._seq = GENESIS, 0

    def msg(self, **event: Any) -> None:
        with self._lock:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX)
            try:
                self._append(event)
            finally:
                fcntl.flock(self._lockfile, fcntl.LOCK_UN)

    def _append(self, event: dict[str, Any]) -> None:
        self._sync_with_disk()
        event["seq"], event["prev"] = self._seq + 1, self._prev
        line = json.dumps(event, separators=(",", ":"), default=str).encode()
        if self._end > 0 and self._end + len(line) + 1 > self.max_bytes:
            self._rotate()
        assert self._fd is not None
        os.write(self._fd, line + b"\n")
        self._end += len(line) + 1
        self._prev, self._seq = line_hash(line), self._seq + 1

    def _sync_with_disk(self) -> None:
        """Reopen after another process rotated; re-read the tail if another process wrote."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is None or st.st_ino != self._ino:
            self._open()
            st = os.fstat(self._fd)  # type: ignore[arg-type]
        if st.st_size != self._end:
            self._load_tail(st.st_size)

    def _open(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        self._ino = os.fstat(self._fd).st_ino
        self._end = -1

    def _load_tail(self, size: int) -> None:
        tail = last_line(self.path)
        if tail is None:  # a fresh file continues the chain of the one rotated before it
            tail = last_line(rotated_name(self.path, 1))
        if tail is None:
            self._prev, self._seq = GENESIS, 0
        else:
            self._prev, self._seq = line_hash(tail), int(json.loads(tail)["seq"])
        self._end = size

    def _rotate(self) -> None:
        for index in range(self.backups - 1, 0, -1):
            older = rotated_name(self.path, index)
            if older.exists():
                os.replace(older, rotated_name(self.path, index + 1))
        os.replace(self.path, rotated_name(self.path, 1))
        self._open()
        self._end = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.close(self._lockfile)


class AuditLog:
    """Builds each record through structlog and hands it to the chained file."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.file = ChainedFile(path, max_bytes, backups)
        self._log = structlog.wrap_logger(
            self.file,
            processors=[structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"), _as_kwargs],
            wrapper_class=structlog.BoundLogger,
        )

    def write(self, **record: Any) -> None:
        self._log.msg("request", **record)

    def close(self) -> None:
        self.file.close()


def _as_kwargs(_: Any, __: str, event: dict[str, Any]) -> tuple[tuple[()], dict[str, Any]]:
    # Put time first so a human reading the file sees it at the start of each line.
    event.pop("event", None)
    ordered = {"time": event.pop("time"), **event}
    return (), ordered
