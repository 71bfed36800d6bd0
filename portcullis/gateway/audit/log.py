"""`AuditLog`: one chained JSON line per request, keyed and signed, written by a thread off
the event loop, flushed, size-rotated, bounded.

Each line carries `seq`, `key` (the id of the audit keyring's chain key), `prev` (the previous
line's MAC) and last `mac`: HMAC-SHA256, under that key, of the line's bytes before `,"mac"`.
Editing, removing or reordering any line breaks the chain that `portcullis audit verify` walks,
and without the key (kept outside the log's folder, `gateway.audit.keys`) nobody can rewrite
the log with a chain that verifies. Every `checkpoint_lines` lines or `checkpoint_interval_s`
seconds, and at close, a `checkpoint` notice signs the chain head with Ed25519. Without a
keyring (logs written before keys existed) `prev` is the SHA-256 of the previous line and
there is no `key` or `mac`: such a chain shows edits, but not a whole rewrite.
Several gateway worker processes share one file and one chain: every append happens under
an exclusive lock, and a writer that sees the file grew (or was rotated) since its own last
append re-reads the tail before chaining onto it.

Clients choose much of what is audited (model, path, user agent...), so every value is cut to
`FIELD_LIMIT` bytes of JSON with a marker saying how long it was: a request line stays under
8 KiB. A logged prompt (`audit.log_prompts`) may take `PROMPT_LIMIT`, and so may a FIM suffix;
`prompt_hmac` (`suffix_hmac`, see `gateway.body`) always covers the whole prompt (suffix).
Besides request lines the chain holds a few notices, marked by `event`: `checkpoint` (above), `torn_tail` (the last line was
cut short by a crash or a full disk; the writer ended it and chains on from the last whole
record), `chain_reset` (the file was moved aside, truncated or replaced under a running writer,
which chains on from the head it had) and `audit_resumed` (writing works again after failures,
or the queue drained after lines past its bound were dropped; says how many lines were lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from portcullis.gateway.audit.keys import AuditKeyring, KeyringError, checkpoint_message

log = structlog.get_logger("portcullis.gateway.audit")

GENESIS = "0" * 64
TAIL_CHUNK = 64 * 1024
FIELD_LIMIT = 256  # bytes of JSON per audited value
PROMPT_LIMIT = 32 * 1024  # for the prompt text itself, when the policy logs prompts
PROBE_INTERVAL_S = 1.0  # how often a failed log is retried, and free space checked
DISK_RESERVE_BYTES = 1 << 20  # below this much free space, stop admitting: lines in flight still fit
MAX_BATCH = 256  # lines the writer appends under one lock, when that many have piled up
# Lines waiting for the writer: past either bound the log counts as unwritable (requests are
# refused until the queue is back under half); at twice the bound a line is not queued at all
# but counted lost. A disk slower than the request rate then costs refusals, never memory.
MAX_QUEUED_LINES = 10_000
MAX_QUEUED_BYTES = 16 * 1024 * 1024
CHECKPOINT_LINES = 1000  # a signed checkpoint after this many lines...
CHECKPOINT_INTERVAL_S = 60.0  # ...or this long after the first line it does not cover yet
KEYRING_CHECK_S = 1.0  # how often the writer looks for a rotated keyring
MAC_FIELD = b',"mac":"'
MAC_TAIL = len(MAC_FIELD) + 64 + 2  # ,"mac":"<64 hex>"}


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def split_mac(line: bytes) -> tuple[bytes, str] | None:
    """(the bytes the MAC covers, the MAC) of a keyed line; None for an unkeyed one."""
    tail = line[-MAC_TAIL:]
    if len(line) > MAC_TAIL and tail.startswith(MAC_FIELD) and tail.endswith(b'"}'):
        return line[:-MAC_TAIL], tail[len(MAC_FIELD):-2].decode("ascii", "replace")
    return None


def head_of(line: bytes) -> str:
    """What the next line's `prev` holds: a keyed line's MAC, else the line's SHA-256."""
    keyed = split_mac(line)
    return keyed[1] if keyed else line_hash(line)


def rotated_name(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def utc_stamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def open_record(record: dict[str, Any]) -> bytes:
    """A record's JSON line without its closing brace: the chain adds `seq` and `prev`."""
    return json.dumps(record, separators=(",", ":"), default=str).encode()[:-1]


# ---- bounding ---------------------------------------------------------------------------

# One encoder for every value (json.dumps builds a new one per call when given `default`),
# and its C string escaper for the common case: the same bytes the line itself will hold.
_ENCODE = json.JSONEncoder(default=str).encode
_ENCODE_STR = json.encoder.encode_basestring_ascii
_NUMBERS = (bool, int, float)  # a tuple: `bool | int | float` would be built on every call
_MAX_ESCAPE = 12  # bytes of JSON one character can take: a surrogate pair, \ud83d\ude00


def _json_len(value: Any) -> int:
    return len(_ENCODE_STR(value) if isinstance(value, str) else _ENCODE(value))


def bounded(value: Any, limit: int = FIELD_LIMIT) -> Any:
    """`value` as it may go into a line: its JSON at most `limit` bytes. Longer values become
    their text cut short, ending with a marker that gives the full length."""
    if value is None or isinstance(value, _NUMBERS):
        return value
    if isinstance(value, str) and len(value) * _MAX_ESCAPE + 2 <= limit:
        return value  # short enough whatever it holds: no need to encode it
    if _json_len(value) <= limit:
        return value
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    marker = f"...[cut: {len(text)} chars in all]"
    keep, budget = text[:limit], limit - len(marker)
    while keep and _json_len(keep) > budget:  # escapes make some chars cost up to 12 bytes
        keep = keep[: len(keep) * budget // _json_len(keep)]
    return keep + marker


PROMPT_KEYS = frozenset({"prompt", "suffix"})  # a FIM suffix is logged as the prompt is


def bounded_record(record: dict[str, Any]) -> dict[str, Any]:
    return {k: bounded(v, PROMPT_LIMIT if k in PROMPT_KEYS else FIELD_LIMIT) for k, v in record.items()}


# ---- reading the tail -------------------------------------------------------------------

@dataclass
class Tail:
    """The end of a log file: its last whole record, and any bytes after its last newline."""

    record: bytes | None = None
    torn: bytes = b""  # bytes after the last newline that are not a whole record
    unterminated: bool = False  # the file does not end with a newline


def _parse_seq(line: bytes) -> int | None:
    try:
        return int(json.loads(line)["seq"])
    except (ValueError, KeyError, TypeError):
        return None


def read_tail(path: Path) -> Tail:
    """Scan back from the end, a chunk at a time, for the last line that is a whole record."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return Tail()
    with handle:
        end = handle.seek(0, os.SEEK_END)
        data, start = b"", end
        while start > 0:
            start = max(0, start - TAIL_CHUNK)
            handle.seek(start)
            data = handle.read(end - start)
            tail = _tail_in(data, start == 0)
            if tail is not None:
                return tail
        return _tail_in(data, True) or Tail()


def _tail_in(data: bytes, whole_file: bool) -> Tail | None:
    """The tail if `data` (the file's last bytes) is enough to tell it, else None."""
    body, _, rest = data.rpartition(b"\n")
    if rest and _parse_seq(rest) is not None:  # whole, only its newline lost: keep it
        return Tail(rest, b"", True)
    lines = body.split(b"\n")
    for index in range(len(lines) - 1, -1, -1):
        if index == 0 and not whole_file:
            return None  # the first line may be cut by the chunk boundary: read further back
        if lines[index] and _parse_seq(lines[index]) is not None:
            return Tail(lines[index], rest, bool(rest))
    return Tail(None, rest, bool(rest))


# ---- writing ----------------------------------------------------------------------------

class ChainedFile:
    """Appends chained lines, across processes: each batch under one exclusive lock.

    A line that cannot be written is reported (OSError) and the file's tail is re-read before
    the next one, so a half-written line is ended and explained rather than chained onto.
    """

    def __init__(self, path: Path, max_bytes: int, backups: int, keyring: AuditKeyring | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.keyring = keyring  # None: the unkeyed SHA-256 chain of logs from before keys
        self._keyring_checked = time.monotonic()
        self._keyring_mtime = _mtime(keyring.path) if keyring and keyring.path else None
        self._lock = threading.Lock()
        self.mirror: Callable[[list[bytes]], None] | None = None  # sent each line once it is written
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lockfile = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        self._fd: int | None = None
        self._ino = -1
        self._end = -1
        self._prev, self._seq = GENESIS, 0

    def msg(self, **event: Any) -> None:
        """Append one record; raises OSError if it could not be."""
        [error] = self.append([open_record(event)])
        if error is not None:
            raise error

    def checkpoint(self) -> bool:
        """Append a `checkpoint` notice signing the chain head as it is on disk; False when
        there is nothing to sign (no signing key, or an empty chain). Raises OSError."""
        with self._lock:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX)
            try:
                self._sync_with_disk()
                signer = self.keyring.current_signing if self.keyring else None
                if signer is None or self._seq == 0:
                    return False
                stamp = utc_stamp()
                signature = signer.sign(checkpoint_message(self._seq, self._prev, stamp))
                self._append({"time": stamp, "event": "checkpoint", "signer": signer.id, "head_seq": self._seq,
                              "head": self._prev, "sig": signature})
                return True
            finally:
                fcntl.flock(self._lockfile, fcntl.LOCK_UN)

    def append(self, records: list[bytes]) -> list[OSError | None]:
        """Chain and append records (each from `open_record`), in order, under one lock and in
        one write (more across rotations): for each, None once it is in the file, or the error
        that kept it out. After a failed write the tail is re-read and the rest tried again."""
        results: list[OSError | None] = []
        with self._lock:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX)
            try:
                while len(results) < len(records):
                    results += self._write_run(records[len(results):])
            finally:
                fcntl.flock(self._lockfile, fcntl.LOCK_UN)
        return results

    def _write_run(self, records: list[bytes]) -> list[OSError | None]:
        """One write of the records that fit before the next rotation: None for each of them;
        or, if it failed, None for those that reached the file whole, then the error for the
        one it failed in (the records after it are left for the next run)."""
        start, lines = self._end, []
        try:
            self._sync_with_disk()  # another process may have written since we last held the lock
            first = self._line(records[0])  # chained (and MACed) once: a rotation keeps the chain
            if self._end > 0 and self._end + len(first[0]) + 1 > self.max_bytes:
                self._rotate()
            start, lines = self._end, self._lines(records, first)
            self._write(b"".join(line + b"\n" for line, _ in lines))
        except OSError as exc:
            whole = 0  # lines that reached the file before the error, with their newline
            while whole < len(lines) and start + sum(len(x) + 1 for x, _ in lines[:whole + 1]) <= self._end:
                whole += 1
            self._keep(lines[:whole])
            self._end = -1  # whatever reached the file, re-read it next time
            return [None] * whole + [exc]
        self._keep(lines)
        return [None] * len(lines)

    def _line(self, record: bytes, seq: int = 0, prev: str = "") -> tuple[bytes, str]:
        """The record chained after (`seq`, `prev`), this file's head by default, and the
        head it makes (its MAC; its SHA-256 when there is no keyring)."""
        seq, prev = (seq, prev) if prev else (self._seq, self._prev)
        key = self.keyring.current_chain if self.keyring else None
        if key is None:
            line = b'%s,"seq":%d,"prev":"%s"}' % (record, seq + 1, prev.encode())
            return line, line_hash(line)
        body = b'%s,"seq":%d,"key":"%s","prev":"%s"' % (record, seq + 1, key.id.encode(), prev.encode())
        mac = key.mac(body)
        return b'%s,"mac":"%s"}' % (body, mac.encode()), mac

    def _lines(self, records: list[bytes], first: tuple[bytes, str]) -> list[tuple[bytes, str]]:
        """Lines (and their hashes) for the records that fit in the file as it is now; `first`
        is the first record's, already made."""
        lines: list[tuple[bytes, str]] = []
        seq, prev, size = self._seq, self._prev, self._end
        for index, record in enumerate(records):
            line, head = self._line(record, seq, prev) if index else first
            if lines and size + len(line) + 1 > self.max_bytes:
                break
            lines.append((line, head))
            seq, prev, size = seq + 1, lines[-1][1], size + len(line) + 1
        return lines

    def _keep(self, written: list[tuple[bytes, str]]) -> None:
        if written:
            self._prev, self._seq = written[-1][1], self._seq + len(written)
            if self.mirror is not None:
                self.mirror([line for line, _ in written])

    def _append(self, event: dict[str, Any]) -> None:
        """One notice of the chain's own, within a sync; raises OSError if it failed."""
        line, head = self._line(open_record(event))
        if self._end > 0 and self._end + len(line) + 1 > self.max_bytes:
            self._rotate()
        self._write(line + b"\n")
        self._keep([(line, head)])

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:  # a short write (disk nearly full) must not pass for a whole line
            written = os.write(self._fd, view)
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]
            self._end += written

    def _sync_with_disk(self) -> None:
        """Reopen after another process rotated; re-read the tail if another process wrote."""
        self._refresh_keyring()
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
        tail = read_tail(self.path)
        line = tail.record
        if line is None:  # a fresh file continues the chain of the one rotated before it
            line = read_tail(rotated_name(self.path, 1)).record
        found = (head_of(line), _parse_seq(line) or 0) if line else (GENESIS, 0)
        self._end = size
        if tail.unterminated:
            self._write(b"\n")  # end the cut line, so the next record starts on its own
        if self._seq and not self._extends(*found):
            self._reset(*found)
            return
        self._prev, self._seq = found
        if tail.torn:
            self._append({"time": utc_stamp(), "event": "torn_tail", "torn_bytes": len(tail.torn),
                          "torn_sha256": line_hash(tail.torn)})

    def _extends(self, head: str, seq: int) -> bool:
        """Whether the head found on disk is ours or grew from it (other writers appended)."""
        return seq > self._seq or (seq == self._seq and head == self._prev)

    def _reset(self, found_head: str, found_seq: int) -> None:
        # Not our rotation: someone moved, truncated or replaced the file. Chaining on from
        # what is there would hide that; starting over from genesis would verify as "OK".
        log.error("audit_chain_reset", path=str(self.path), previous_seq=self._seq, found_seq=found_seq,
                  message="the audit log was moved aside, truncated or replaced; continuing its chain")
        self._append({"time": utc_stamp(), "event": "chain_reset", "previous_seq": self._seq,
                      "previous_head": self._prev, "found_seq": found_seq, "found_head": found_head})

    def _refresh_keyring(self) -> None:
        """Take up a keyring rotated by `portcullis audit rotate-key` (checked once a second)."""
        if self.keyring is None or self.keyring.path is None or time.monotonic() < self._keyring_checked + KEYRING_CHECK_S:
            return
        self._keyring_checked = time.monotonic()
        mtime = _mtime(self.keyring.path)
        if mtime == self._keyring_mtime:
            return
        try:
            self.keyring = AuditKeyring.load(self.keyring.path)
        except KeyringError as exc:  # keep chaining with the keys in hand; say why not the new ones
            log.error("audit_keyring_unreadable", error=str(exc))
        self._keyring_mtime = mtime

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


def _no_wakeup_preemption() -> None:
    """Put the calling thread (the writer) in Linux's SCHED_BATCH class: as much CPU as before,
    but waking it (a line queued per request) no longer preempts the thread that woke it. The
    event loop would otherwise lose its core at every line, for a writer that cannot run
    before the loop lets go of the GIL anyway: about 14 us a request, and the GIL handed back
    and forth. Elsewhere this is a no-op."""
    if hasattr(os, "SCHED_BATCH"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: this thread


def _mtime(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@dataclass
class Drained:
    """A backlog's end: since when it was full, and what it cost."""

    since: str
    refused: int  # requests refused while it was full
    dropped: int  # lines never queued (twice the bound)


class Backlog:
    """The lines queued for the writer, counted and bounded; callable from any thread.

    `full` turns on past `max_lines` or `max_bytes` and off again at half of both, so a queue
    hovering at the bound does not flap between serving and refusing."""

    def __init__(self, max_lines: int, max_bytes: int) -> None:
        self.max_lines, self.max_bytes = max_lines, max_bytes
        self.lines = self.bytes = 0
        self.full = False
        self._since = ""
        self._refused = self._dropped = 0
        self._lock = threading.Lock()

    def add(self, size: int) -> str | None:
        """Count one line in. Returns "full" when this line filled the queue, "drop" (and
        "dropping" for the first of a backlog) when it must not be queued, else None."""
        with self._lock:
            if self.lines >= 2 * self.max_lines or self.bytes + size > 2 * self.max_bytes:
                self._dropped += 1
                return "dropping" if self._dropped == 1 else "drop"
            self.lines, self.bytes = self.lines + 1, self.bytes + size
            if self.full or (self.lines <= self.max_lines and self.bytes <= self.max_bytes):
                return None
            self.full, self._since = True, utc_stamp()
            return "full"

    def remove(self, lines: int, size: int) -> Drained | None:
        """Count written (or lost) lines out; the `Drained` report once the backlog is over."""
        with self._lock:
            self.lines, self.bytes = self.lines - lines, self.bytes - size
            if not self.full or self.lines > self.max_lines // 2 or self.bytes > self.max_bytes // 2:
                return None
            drained = Drained(self._since, self._refused, self._dropped)
            self.full, self._refused, self._dropped = False, 0, 0
            return drained

    def refused(self) -> None:
        with self._lock:
            self._refused += 1


class AuditLog:
    """Takes each request's record and has one writer thread append it to the chained file.

    The event loop never waits on the disk: `write()` bounds the record, stamps its time,
    encodes it and queues it. The one writer thread takes the queue in order (what has piled up
    at once goes under one lock), so lines are chained in the order they were submitted;
    `close()` (and `flush()`) wait until it has written everything queued before them, so no
    submitted line is dropped at shutdown.

    A line that cannot be written (disk full, I/O error, permissions) does not raise into the
    request: the writer marks the log failed, `writable()` says so, and the proxy refuses new
    requests (503) unless the policy says to serve them unaudited. At most once per
    `PROBE_INTERVAL_S`, `writable()` checks free space itself (one statvfs, no write: its answer
    is for the request asking, which must not wait behind the queue) and, if the log failed,
    has the writer retry it, in turn after the lines queued before, and waits for that.

    The queue is bounded (`Backlog`): while more than `max_queued_lines` lines (or
    `max_queued_bytes`) wait for a slow disk, `writable()` is False at once, as after a failed
    write, until the writer has brought the queue back under half; lines past twice the bound
    are dropped, and an `audit_resumed` notice counts them once the queue has drained.
    """

    def __init__(self, path: Path, max_bytes: int, backups: int, max_queued_lines: int = MAX_QUEUED_LINES,
                 max_queued_bytes: int = MAX_QUEUED_BYTES, *, keyring: AuditKeyring | None = None,
                 checkpoint_lines: int = CHECKPOINT_LINES, checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
                 mirror: Callable[[list[bytes]], None] | None = None) -> None:
        self.path = path
        self.file = ChainedFile(path, max_bytes, backups, keyring)
        self.file.mirror = mirror  # the chained lines as written, on the writer thread (gateway.syslog)
        self.checkpoint_lines, self.checkpoint_interval_s = checkpoint_lines, checkpoint_interval_s
        self._unsigned = 0  # lines this writer appended since its last checkpoint (the writer's alone)
        self._sign_by: float | None = None  # when those lines must be signed at the latest
        self.backlog = Backlog(max_queued_lines, max_queued_bytes)
        self._state = threading.Lock()  # the writer and the loop's check may both mark a failure
        self.failure: str | None = None  # why lines cannot be written now; None when they can
        self._failed_since: str | None = None
        self._lost = 0  # the writer's alone
        self._next_check = 0.0  # pushed back by a failure too
        self._retry: Future[None] | None = None  # the writer's latest retry of a failed log
        # A line to append, something to run in its turn (a retry, a flush), or None: stop.
        self._jobs: queue.SimpleQueue[bytes | Callable[[], None] | None] = queue.SimpleQueue()
        self._submitting = threading.Lock()  # so nothing is queued behind the stop marker
        self._closed = False
        self._writer = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._writer.start()

    # ---- called from the event loop (or any thread) -------------------------------------

    def write(self, **record: Any) -> None:
        """Queue one request's line; the writer appends it, or counts it lost and marks the
        log failed if it cannot be written."""
        # Time first, so a human reading the file sees it at the start of each line.
        line = open_record({"time": utc_stamp(), **bounded_record(record)})
        if not self._queue(line):
            return
        if not self._submit(line):
            self.backlog.remove(1, len(line))
            log.error("audit_write_after_close", path=str(self.path), request_id=record.get("request_id"))

    def _queue(self, line: bytes) -> bool:
        """Count `line` into the backlog; False when it is too long to take it."""
        change = self.backlog.add(len(line))
        if change == "full":
            log.error("audit_backlog_full", path=str(self.path), queued_lines=self.backlog.lines,
                      queued_bytes=self.backlog.bytes,
                      message="audit lines are queued faster than the disk takes them; requests are refused "
                              "unless audit.on_failure is serve, until the queue is back under half")
        elif change == "dropping":
            log.error("audit_lines_dropped", path=str(self.path), queued_lines=self.backlog.lines,
                      message="the audit queue is at twice its bound; further lines are lost until it drains")
        return change not in ("drop", "dropping")

    def count_refusal(self) -> str:
        """Count one request refused because it could not be audited; returns why: "backlog"
        (the queue is over its bound) or "failure" (lines cannot be written)."""
        if self.backlog.full:
            self.backlog.refused()
            return "backlog"
        return "failure"

    async def writable(self) -> bool:
        """Whether lines can be written; when a retry of a failed log is under way, after it.
        False at once while the queue is over its bound."""
        if self.backlog.full:
            return False
        now = time.monotonic()
        retrying = self._retry is not None and not self._retry.done()
        if now >= self._next_check and not retrying:
            self._next_check = now + PROBE_INTERVAL_S
            short = self._disk_short()
            if short:
                self._failed(short)
            elif self.failure is not None:
                self._retry = self._on_writer(self._resume)
        if self._retry is not None and not self._retry.done():
            await asyncio.wrap_future(self._retry)
        return self.failure is None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every line queued so far is written (or counted lost); False on timeout."""
        done = threading.Event()
        return not self._submit(done.set) or done.wait(timeout)

    def close(self) -> None:
        """Stop taking lines; return once the writer has written what was queued and closed
        the file."""
        with self._submitting:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        self._writer.join()

    def _submit(self, job: bytes | Callable[[], None]) -> bool:
        with self._submitting:
            if self._closed:
                return False
            self._jobs.put(job)
            return True

    def _on_writer(self, job: Callable[[], None]) -> Future[None]:
        """`job` run by the writer in its turn; the future is done once it ran (or never will)."""
        done: Future[None] = Future()

        def run() -> None:
            try:
                job()
            finally:
                done.set_result(None)

        if not self._submit(run):
            done.set_result(None)
        return done

    def _disk_short(self) -> str | None:
        try:
            st = os.statvfs(self.path.parent)
        except OSError as exc:
            return exc.strerror or str(exc)
        free = st.f_bavail * st.f_frsize
        return f"only {free} bytes free on the audit log's disk" if free < DISK_RESERVE_BYTES else None

    def _failed(self, why: str) -> None:
        with self._state:
            first, self.failure = self.failure is None, why
            if first:
                self._failed_since = utc_stamp()
            self._next_check = time.monotonic() + PROBE_INTERVAL_S
        if first:
            log.error("audit_write_failed", path=str(self.path), error=why,
                      message="the audit log cannot be written; requests are refused unless "
                              "audit.on_failure is serve")

    # ---- on the writer thread -----------------------------------------------------------

    def _run(self) -> None:
        _no_wakeup_preemption()
        while True:
            lines: list[bytes] = []
            for job in self._take():
                if isinstance(job, bytes):
                    lines.append(job)
                    continue
                self._guarded(partial(self._append, lines))  # the lines queued before it go first
                lines = []
                if job is None:  # nothing is queued behind it
                    if self._unsigned:
                        self._guarded(self._checkpoint)
                    self.file.close()
                    return
                self._guarded(job)
            self._guarded(partial(self._append, lines))
            if self._unsigned >= self.checkpoint_lines or (
                    self._sign_by is not None and time.monotonic() >= self._sign_by):
                self._guarded(self._checkpoint)

    def _take(self) -> list[bytes | Callable[[], None] | None]:
        """What is queued now (at least one job, waiting for it, or none once a checkpoint is
        due), up to MAX_BATCH."""
        try:
            wait = None if self._sign_by is None else max(0.0, self._sign_by - time.monotonic())
            jobs = [self._jobs.get(timeout=wait)]
        except queue.Empty:
            return []
        with contextlib.suppress(queue.Empty):
            while len(jobs) < MAX_BATCH:
                jobs.append(self._jobs.get_nowait())
        return jobs

    def _guarded(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # noqa: BLE001 - every later line needs this thread alive
            log.exception("audit_writer_error", path=str(self.path))

    def _append(self, lines: list[bytes]) -> None:
        if not lines:
            return
        try:
            errors = self.file.append(lines)
        except OSError as exc:  # the lock itself failed: none of them reached the file
            errors = [exc] * len(lines)
        finally:
            drained = self.backlog.remove(len(lines), sum(map(len, lines)))
        failed = [error for error in errors if error is not None]
        if len(failed) < len(lines) and self.file.keyring is not None:
            self._unsigned += len(lines) - len(failed)
            if self._sign_by is None:
                self._sign_by = time.monotonic() + self.checkpoint_interval_s
        if failed:
            self._lost += len(failed)
            self._failed(failed[-1].strerror or str(failed[-1]))
        if drained is not None:
            self._backlog_drained(drained)

    def _checkpoint(self) -> None:
        try:
            self.file.checkpoint()
        except OSError as exc:  # tried again with the next line or at the next interval
            self._failed(exc.strerror or str(exc))
            self._sign_by = time.monotonic() + PROBE_INTERVAL_S
            return
        self._unsigned, self._sign_by = 0, None

    def _backlog_drained(self, drained: Drained) -> None:
        log.warning("audit_backlog_drained", path=str(self.path), full_since=drained.since,
                    refused_requests=drained.refused, lost_records=drained.dropped)
        if not drained.dropped:
            return  # every line was written: the refusals' own lines say what happened
        try:
            self.file.msg(time=utc_stamp(), event="audit_resumed", failed_since=drained.since,
                          error="the audit queue was full", lost_records=drained.dropped)
        except OSError as exc:  # the usual retry will write the notice, with these counted
            self._lost += drained.dropped
            self._failed(exc.strerror or str(exc))

    def _resume(self) -> None:
        with self._state:
            failure, since = self.failure, self._failed_since
        try:
            self.file.msg(time=utc_stamp(), event="audit_resumed", failed_since=since, error=failure,
                          lost_records=self._lost)
        except OSError as exc:
            with self._state:
                self.failure = exc.strerror or str(exc)
            return
        log.warning("audit_resumed", path=str(self.path), lost_records=self._lost)
        with self._state:
            self.failure, self._failed_since = None, None
        self._lost = 0

