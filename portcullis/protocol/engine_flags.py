"""The engine flags that others read too, defined once: the engine's command line adds them with
`add_shared_flags`, and `portcullis serve`, which starts engines as programs and never imports
them, reads a flag list with `read_shared_flags`, so both parse `--served-model-name x y` (and
`=x,y`, which is one name to both) the same way."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

DEFAULT_MAX_NUM_SEQS = 256  # as vLLM's


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def add_shared_flags(group: Any) -> None:
    """Add them to `group` (a parser or an argument group)."""
    group.add_argument("--served-model-name", nargs="+", help="name(s) clients use in `model` (default: MODEL)")
    group.add_argument("--max-num-seqs", type=positive_int, default=DEFAULT_MAX_NUM_SEQS,
                       help=f"requests decoded together (default {DEFAULT_MAX_NUM_SEQS})")


def read_shared_flags(flags: Sequence[str]) -> argparse.Namespace:
    """The shared flags in an engine's flag list, as the engine will read them; the rest is left
    to the engine. A malformed value is the engine's to refuse: here it reads as the default."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_shared_flags(parser)
    try:
        known, _ = parser.parse_known_args(list(flags))
    except (argparse.ArgumentError, SystemExit):
        known = parser.parse_args([])
    return known
