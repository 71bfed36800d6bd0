"""Reading the audit log back: verify the chain, filter records, summarise for reviewers."""

from __future__ import annotations

import glob
import hmac
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from portcullis.gateway.audit.keys import AuditKeyring, checkpoint_message
from portcullis.gateway.audit.log import GENESIS, head_of, line_hash, split_mac
from portcullis.gateway.policy.models import utc_period

WHERE = re.compile(r"^[^\s:]+:\d+")  # file:line at the start of a problem


def log_files(path: Path) -> list[Path]:
    """The live file and its rotations, oldest first (the order the chain runs in).

    Every `NAME.<n>` counts, not only an unbroken run from `.1`, so a removed middle file shows
    up as a break in the chain instead of silently hiding the older files."""
    numbered = []
    for candidate in path.parent.glob(f"{glob.escape(path.name)}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit() and candidate.is_file():
            numbered.append((int(suffix), candidate))
    files = [file for _, file in sorted(numbered, reverse=True)]
    return files + ([path] if path.exists() else [])


def raw_lines(path: Path) -> Iterator[tuple[Path, int, bytes]]:
    for file in log_files(path):
        with open(file, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                yield file, number, line


@dataclass
class Verdict:
    ok: bool = True
    lines: int = 0
    first_seq: int | None = None
    head: str = GENESIS
    keyed: int = 0  # lines with a MAC
    checkpoints: int = 0  # signed checkpoints whose signature held
    first_bad: str | None = None  # file:line of the first problem in the chain
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Previous:
    where: str
    hash: str
    seq: int | None
    own_link_ok: bool


def verify(path: Path, known_head: str | None = None, keyring: AuditKeyring | None = None,
           backups: int | None = None) -> Verdict:
    """Walk the chain; every edited, removed or reordered line shows up as a problem.

    With the `keyring`, each keyed line's MAC is checked under the key it names (old keys
    stay in the keyring, so lines from before a rotation still verify), each `checkpoint`'s
    Ed25519 signature and the head it signs; a line without a MAC after keyed ones, or
    stamped after the keys were made, is a problem (a rewrite by someone without the key).
    Lines from before keys existed verify as a plain SHA-256 chain, with a note saying so.

    `known_head` is a head hash printed by an earlier verify: it must still be in the chain,
    which is what catches records cut from the end (the one change the chain alone cannot see).
    `backups` is how many rotated files the writer keeps (the policy's `audit.backups`): a chain
    that starts after seq 1 while fewer are here cannot have lost its head to rotation.
    The writer's notices are explained: a cut line it ended (`torn_tail`) is a note, a file
    moved aside under it (`chain_reset`) a problem until the moved records are back in place.
    """
    verdict = Verdict()
    prev: _Previous | None = None
    cut: _Cut | None = None  # the line before, when it was not a record
    files = log_files(path)
    head_seen = known_head in (None, GENESIS)
    reset_at_start = False
    keys = _KeyCheck(verdict, keyring)
    if files and not path.exists():
        verdict.problems.append(f"{path.name} is missing (deleted?); only its rotated files were checked")
    for file, number, raw in raw_lines(path):
        where = f"{file.name}:{number}"
        line = raw.rstrip(b"\n")
        record = _parse(line)
        if record is None:
            problem = f"{where}: {_not_a_record(raw, line, file is files[-1])}"
            verdict.problems.append(problem)
            cut, prev = _Cut(where, line, problem, prev), _Previous(where, line_hash(line), None, False)
            continue
        seq, claimed, event = record
        mac_ok = keys.line(where, line, event)
        if event.get("event") == "checkpoint":
            keys.checkpoint(where, seq, claimed, event)
        if event.get("event") == "torn_tail" and cut is not None and cut.explained_by(event):
            verdict.problems.remove(cut.problem)
            verdict.notes.append(f"{cut.where}: an incomplete line ({len(cut.line)} bytes: the gateway stopped "
                                 f"mid-write, or the disk was full); {where} records it and the chain goes on")
            prev = cut.before
        if event.get("event") == "audit_resumed":
            verdict.notes.append(f"{where}: the gateway could not write this log from {event.get('failed_since')} "
                                 f"({event.get('error')}); {event.get('lost_records')} request lines were lost")
        if event.get("event") == "chain_reset":
            link_ok = _check_reset(verdict, where, seq, claimed, event, prev)
            reset_at_start = reset_at_start or prev is None
        else:
            link_ok = _check_link(verdict, where, seq, claimed, prev) and mac_ok
        cut, prev = None, _Previous(where, head_of(line), seq, link_ok)
        head_seen = head_seen or prev.hash == known_head
        verdict.lines += 1
    verdict.head = prev.hash if prev else GENESIS
    if not head_seen:
        verdict.problems.append(f"the head recorded earlier ({known_head}) is not in the log: records were cut "
                                "from its end, or the log was replaced (or rotated out of its backups since)")
    if not reset_at_start:
        _check_start(verdict, [file for file in files if file != path], keys.first, backups)
    keys.finish()
    verdict.ok = not verdict.problems
    verdict.first_bad = next((m.group(0) for m in map(WHERE.match, verdict.problems) if m), None)
    if not files or verdict.lines == 0 and verdict.ok:
        verdict.notes.append("the log holds no records yet")
    return verdict


class _KeyCheck:
    """The keyed half of `verify`: MACs, checkpoint signatures, and lines that lack a MAC."""

    def __init__(self, verdict: Verdict, keyring: AuditKeyring | None) -> None:
        self.verdict, self.keyring = verdict, keyring
        made = keyring.created() if keyring else None
        self.keys_made = parse_time(made) if made else None
        self.unkeyed = 0  # lines before the first keyed one
        self.suspect: list[str] = []  # lines without a MAC where one was due
        self.unchecked = 0  # keyed lines seen without a keyring
        self.since_checkpoint = 0  # lines after the last good checkpoint
        self.first: str | None = None  # where the first record is

    def line(self, where: str, line: bytes, record: dict[str, Any]) -> bool:
        """Whether this line's own MAC holds (True for a line that has none: the chain says)."""
        self.since_checkpoint += 1
        self.first = self.first or where
        keyed = split_mac(line)
        if keyed is None:
            if self.verdict.keyed or self._after_keys(record.get("time")):
                self.suspect.append(where)
            else:
                self.unkeyed += 1
            return True
        self.verdict.keyed += 1
        if self.keyring is None:
            self.unchecked += 1
            return True
        key = self.keyring.chain.get(str(record.get("key")))
        if key is None:
            self.verdict.problems.append(f"{where}: its MAC key {record.get('key')!r} is not in the keyring "
                                         "(a forged line, or verify was given another keyring)")
            return False
        body, mac = keyed
        if not hmac.compare_digest(key.mac(body), mac):
            self.verdict.problems.append(f"{where}: this record was changed after it was written "
                                         "(its MAC does not match)")
            return False
        return True

    def _after_keys(self, stamp: Any) -> bool:
        if self.keys_made is None:
            return False
        try:
            return parse_time(str(stamp)) >= self.keys_made
        except ValueError:  # no usable time on a line that lacks a MAC: it cannot show it is older
            return True

    def checkpoint(self, where: str, seq: int, claimed: str, notice: dict[str, Any]) -> None:
        if self.keyring is None:
            return
        signer = self.keyring.signing.get(str(notice.get("signer")))
        head, head_seq, stamp = str(notice.get("head")), notice.get("head_seq"), str(notice.get("time"))
        if signer is None:
            self.verdict.problems.append(f"{where}: checkpoint signed by {notice.get('signer')!r}, "
                                         "a key the keyring does not hold")
        elif not isinstance(head_seq, int) or not signer.verifies(checkpoint_message(head_seq, head, stamp),
                                                                   str(notice.get("sig"))):
            self.verdict.problems.append(f"{where}: the checkpoint's signature does not verify (forged)")
        elif head != claimed or head_seq != seq - 1:
            self.verdict.problems.append(f"{where}: the checkpoint signs head {head_seq} {head[:16]}..., "
                                         "not the line before it")
        else:
            self.verdict.checkpoints += 1
            self.since_checkpoint = 0

    def finish(self) -> None:
        v = self.verdict
        if self.suspect:
            v.problems.append(f"{self.suspect[0]}: a line without a MAC where the log is keyed (after keyed lines, "
                              f"or stamped after the audit keys were made): {len(self.suspect)} such lines, "
                              "written or rewritten by someone without the key")
        if self.unchecked:
            v.problems.append(f"{self.unchecked} lines carry a MAC but no keyring was given, so they were not "
                              "checked; pass --keyring (or --policy, for its default)")
        if self.keyring is not None and v.lines and not v.keyed and not self.suspect:
            v.problems.append(f"{self.first}: a keyring was given but no line carries a MAC: the log was rewritten without "
                              "the key, or predates it (verify without --keyring to check it as unkeyed)")
        if self.unkeyed:
            v.notes.append(f"{self.unkeyed} lines are unkeyed (a plain SHA-256 chain, written before audit keys): "
                           "the chain shows an edit, but not a rewrite of the whole log")
        if v.keyed and self.keyring is not None and self.since_checkpoint:
            v.notes.append(f"the last {self.since_checkpoint} lines come after the last signed checkpoint "
                           "(lines cut from the end show only against a checkpoint or --head)")


@dataclass
class _Cut:
    """A line that is not a record, and the record before it."""

    where: str
    line: bytes
    problem: str
    before: _Previous | None

    def explained_by(self, notice: dict[str, Any]) -> bool:
        return notice.get("torn_bytes") == len(self.line) and notice.get("torn_sha256") == line_hash(self.line)


def _check_reset(verdict: Verdict, where: str, seq: int, claimed: str, notice: dict[str, Any],
                 prev: _Previous | None) -> bool:
    """A writer found its file moved, truncated or replaced, and chained on from its own head."""
    if prev is None:
        verdict.first_seq = seq
    held = notice.get("previous_seq")
    what = f"{where}: the log was moved aside, truncated or replaced while the gateway wrote it"
    if prev is not None and claimed == prev.hash and seq == (prev.seq or 0) + 1:
        verdict.notes.append(f"{what}; the chain goes on across the files given (it had reached seq {held})")
        return True
    verdict.problems.append(f"{what} (it had written up to seq {held}): those records are not here; "
                            f"put the moved file back as {where.split(':')[0]}.<n> to check them")
    return False


def _check_start(verdict: Verdict, rotated: list[Path], first: str | None, backups: int | None) -> None:
    """A chain that starts after seq 1 lost its head to rotation only if rotation has dropped a
    file: the writer keeps `backups` rotated files and drops the oldest only once all are there."""
    if verdict.first_seq in (None, 1):
        return
    where = f"{first}: the chain starts at seq {verdict.first_seq}, not 1"
    # Rotation never leaves an empty file, so empty ones added beside the log do not count.
    kept = sum(1 for file in rotated if _holds_lines(file))
    if not rotated:  # nothing was ever rotated, so nothing can have been rotated out
        verdict.problems.append(f"{where}, and no rotated file holds the records before it: they were removed "
                                "(if you moved rotated files away, verify with them back in place)")
    elif backups is None:
        verdict.notes.append(f"{where}: older records were in files rotated out since, or were removed: give "
                             "--policy or --backups to tell them apart")
    elif kept >= backups:
        verdict.notes.append(f"{where}: older records were in files rotated out since (audit.backups keeps {backups})")
    else:
        lost = "seq 1" if verdict.first_seq == 2 else f"seq 1-{verdict.first_seq - 1}"
        verdict.problems.append(f"{where}, yet only {kept} rotated files are here of the {backups} audit.backups "
                                f"keeps, so none was rotated out: the records before it ({lost}) were removed "
                                "(if audit.backups was raised since, verify with --backups set to the old value; "
                                "if rotated files were moved away, with them back in place)")


def _holds_lines(file: Path) -> bool:
    try:
        return file.stat().st_size > 0
    except OSError:  # rotated away while verify read
        return False


def _parse(line: bytes) -> tuple[int, str, dict[str, Any]] | None:
    try:
        record = json.loads(line)
        return int(record["seq"]), str(record["prev"]), record
    except (ValueError, KeyError, TypeError):
        return None


def _not_a_record(raw: bytes, line: bytes, last_file: bool) -> str:
    if not line.strip():
        return "empty line (lines were removed or joined by an editor)"
    if not raw.endswith(b"\n") and last_file:
        return "the last line is incomplete (cut short, or the gateway stopped mid-write)"
    return "not an audit record (edited, or not JSON)"


def _check_link(verdict: Verdict, where: str, seq: int, claimed: str, prev: _Previous | None) -> bool:
    """Record what is wrong between `prev` and this line; True when this line's link holds."""
    if prev is None:  # first record we can see
        verdict.first_seq = seq
        return True
    ok = True
    if claimed != prev.hash:
        ok = False
        if prev.own_link_ok and prev.seq is not None and seq == prev.seq + 1:
            # Order and count are right and the line before chained correctly: its bytes changed.
            verdict.problems.append(f"{prev.where}: this record was edited after it was written "
                                    f"(the next line, {where}, holds the hash of a different text)")
        else:
            verdict.problems.append(f"{where}: prev hash does not match {prev.where} "
                                    "(lines edited, removed or reordered here)")
    if prev.seq is not None and seq != prev.seq + 1:
        ok = False
        if seq > prev.seq + 1:
            missing = f"seq {prev.seq + 1}" + (f"-{seq - 1}" if seq - 1 > prev.seq + 1 else "")
            verdict.problems.append(f"{where}: seq {seq} follows {prev.seq}: {missing} removed or moved")
        else:
            verdict.problems.append(f"{where}: seq {seq} follows {prev.seq}: out of order or repeated")
    return ok


@dataclass(frozen=True)
class Filter:
    since: datetime | None = None
    until: datetime | None = None
    principal: str | None = None
    tenant: str | None = None
    status: str | None = None  # "429" or a class such as "4xx"
    decision: str | None = None
    model: str | None = None
    reason: str | None = None
    route: str | None = None  # the policy route, e.g. /v1/chat/completions

    def accepts(self, record: dict[str, Any]) -> bool:
        fields = ("principal", "tenant", "decision", "model", "reason", "route")
        if any(getattr(self, f) is not None and record.get(f) != getattr(self, f) for f in fields):
            return False
        return self._status_ok(record.get("status")) and self._time_ok(record.get("time"))

    def _status_ok(self, status: Any) -> bool:
        if self.status is None:
            return True
        text = str(status)
        if self.status.lower().endswith("xx"):
            return text[:1] == self.status[:1]
        return text == self.status

    def _time_ok(self, stamp: Any) -> bool:
        if self.since is None and self.until is None:
            return True
        try:
            when = parse_time(str(stamp))
        except ValueError:  # no usable time: cannot be inside a time range
            return False
        return (self.since is None or when >= self.since) and (self.until is None or when < self.until)


def parse_time(text: str) -> datetime:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def records(path: Path, flt: Filter) -> Iterator[dict[str, Any]]:
    """The request records that pass `flt` (the writer's own notices are left to `verify`)."""
    for _, _, line in raw_lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "event" not in record and flt.accepts(record):
            yield record


def summarise(items: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """Requests and tokens per principal and per tenant, and denials by reason."""
    per: dict[str, dict[str, dict[str, int]]] = {"principal": {}, "tenant": {}}
    denials: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    for record in items:
        statuses[str(record.get("status"))] += 1
        if record.get("decision") == "denied":
            denials[str(record.get("reason"))] += 1
        for kind in per:
            _add(per[kind], str(record.get(kind) or "-"), record)
    return {"by_principal": per["principal"], "by_tenant": per["tenant"],
            "denials_by_reason": dict(denials.most_common()), "by_status": dict(sorted(statuses.items()))}


def _add(table: dict[str, dict[str, int]], name: str, record: dict[str, Any]) -> None:
    row = table.setdefault(name, defaultdict(int))
    row["requests"] += 1
    row["denied"] += record.get("decision") == "denied"
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        row[key] += int(record.get(key) or 0)


USAGE_BY = ("tenant", "principal", "model")
USAGE_COLUMNS = ("requests", "denied", "failed", "prompt_tokens", "completion_tokens", "total_tokens",
                 "estimated_tokens")


def period_range(period: str, now: datetime) -> tuple[datetime, datetime]:
    """A UTC calendar period as [start, end): `day` or `month` is the one holding `now`,
    `2026-12-01` that day, `2026-12` that month (the gateway's budgets count the same periods)."""
    if period in ("day", "month"):
        return utc_period(period, now)
    if re.fullmatch(r"\d{4}-\d{2}", period):
        return utc_period("month", datetime.strptime(period, "%Y-%m").replace(tzinfo=timezone.utc))
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", period):
        return utc_period("day", datetime.strptime(period, "%Y-%m-%d").replace(tzinfo=timezone.utc))
    raise ValueError(f"{period!r} is not a period: give day, month, a month (2026-12) or a day (2026-12-01)")


def usage(items: Iterator[dict[str, Any]], by: tuple[str, ...] = USAGE_BY) -> list[dict[str, Any]]:
    """Chargeback rows, one per combination of `by` (tenant, principal, model): requests the
    gateway forwarded (`requests`; `failed` when the engine or the gateway failed them, which
    may still have used tokens), refused (`denied`), and the tokens the engine reported. A line
    with `tokens_estimated` carries the gateway's worst-case guess (the engine reported nothing,
    e.g. the stream broke): its tokens go to `estimated_tokens`, never into the reported counts."""
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    for record in items:
        key = tuple(str(record.get(name) or "-") for name in by)
        row = rows.setdefault(key, {**dict(zip(by, key, strict=True)), **dict.fromkeys(USAGE_COLUMNS, 0)})
        decision = record.get("decision")
        row["requests"] += decision != "denied"
        row["denied"] += decision == "denied"
        row["failed"] += decision == "failed"
        counts = {name: int(record.get(name) or 0) for name in ("prompt_tokens", "completion_tokens")}
        if record.get("tokens_estimated"):
            row["estimated_tokens"] += sum(counts.values())
            counts = {}
        for name, count in counts.items():
            row[name] += count
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return [rows[key] for key in sorted(rows)]
