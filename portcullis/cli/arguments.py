"""Argument types and output shared by the commands: durations, names, exit codes, plain tables."""

from __future__ import annotations

import argparse
import re
import sys
from datetime import timedelta
from typing import Any

from portcullis.gateway.policy.models import ID_PATTERN

DURATION = re.compile(r"^(\d+)([smhdw])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_DURATION_S = 100 * 365 * 86400


def duration(text: str) -> timedelta:
    match = DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 24h, 90d or 2w")
    seconds = int(match.group(1)) * UNITS[match.group(2)]
    if seconds > MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 100 years; leave the option out for no expiry")
    return timedelta(seconds=seconds)


def positive_duration(text: str) -> timedelta:
    span = duration(text)
    if not span:
        raise argparse.ArgumentTypeError(f"{text!r} would expire at once; give a positive duration such as 90d")
    return span


def name(text: str) -> str:
    if not re.match(ID_PATTERN, text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid name: use letters, digits and _ . : @ - "
                                         "(starting with a letter or digit, at most 128 characters)")
    return text


def fail(message: str, code: int = 1) -> int:
    print(f"portcullis: {message}", file=sys.stderr)
    return code


def printable(text: str) -> str:
    """`text` with each character a terminal would act on, hide or fail to print written as its
    escape (`\\n`, `\\x1b`, `\\u202e`): C0 and C1 controls, DEL, line and paragraph separators,
    bidi overrides and other format characters, lone surrogates. A value a client chose then stays
    on its own row and cannot move the cursor. Backslashes are left as they are: `--json` is exact."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def table(rows: list[dict[str, Any]]) -> str:
    """Rows as aligned columns, one line per row whatever the values hold (see `printable`)."""
    if not rows:
        return "(none)"
    columns = [printable(str(c)) for c in rows[0]]
    cells = [[("" if r.get(c) is None else printable(str(r.get(c)))) for c in rows[0]] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*columns)] + [fmt.format(*row) for row in cells])

