"""Reading the audit log back: verify the chain, filter records, summarise for reviewers."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gateway.audit.log import GENESIS, line_hash, rotated_name


def log_files(path: Path) -> list[Path]:
    """The live file and its rotations, oldest first (the order the chain runs in)."""
    rotated = []
    index = 1
    while rotated_name(path, index).exists():
        rotated.append(rotated_name(path, index))
        index += 1
    files = list(reversed(rotated))
    return files + ([path] if path.exists() else [])


def raw_lines(path: Path) -> Iterator[tuple[Path, int, bytes]]:
    for file in log_files(path):
        with open(file, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                yield file, number, line.rstrip(b"\n")


@dataclass
class Verdict:
    ok: bool = True
    lines: int = 0
    first_seq: int | None = None
    head: str = GENESIS
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def verify(path: Path) -> Verdict:
    """Walk the chain; every edited, removed or reordered line shows up as a problem."""
    verdict = Verdict()
    prev_hash, prev_seq = None, None
    for file, number, line in raw_lines(path):
        where = f"{file.name}:{number}"
        try:
            record = json.loads(line)
            seq, claimed = int(record["seq"]), str(record["prev"])
        except (ValueError, KeyError, TypeError):
            verdict.problems.append(f"{where}: not an audit record")
            prev_hash, prev_seq = line_hash(line), None
            continue
        _check_link(verdict, where, seq, claimed, prev_hash, prev_seq)
        prev_hash, prev_seq = line_hash(line), seq
        verdict.lines += 1
    verdict.head = prev_hash or GENESIS
    verdict.ok = not verdict.problems
    return verdict


def _check_link(
    verdict: Verdict, where: str, seq: int, claimed: str, prev_hash: str | None, prev_seq: int | None
) -> None:
    if prev_hash is None:  # first record we can see
        verdict.first_seq = seq
        if claimed != GENESIS or seq != 1:
            verdict.notes.append(f"{where}: chain starts at seq {seq} (older files rotated out)")
        return
    if claimed != prev_hash:
        verdict.problems.append(f"{where}: prev hash does not match the line before (edited, removed or reordered)")
    if prev_seq is not None and seq != prev_seq + 1:
        verdict.problems.append(f"{where}: seq {seq} follows {prev_seq}")


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

    def accepts(self, record: dict[str, Any]) -> bool:
        fields = ("principal", "tenant", "decision", "model", "reason")
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
        when = parse_time(str(stamp))
        return (self.since is None or when >= self.since) and (self.until is None or when < self.until)


def parse_time(text: str) -> datetime:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def records(path: Path, flt: Filter) -> Iterator[dict[str, Any]]:
    for _, _, line in raw_lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and flt.accepts(record):
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
