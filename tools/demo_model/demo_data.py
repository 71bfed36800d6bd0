"""The demo model's training data, rebuilt offline on any machine: the Python standard library
and the pure-Python sources of this project's installed runtime dependencies, plus documents
shaped like the requests the model will serve (chat: docstring -> function and "rename this";
fill-in-the-middle in Qwen2.5-Coder's PSM order).

A document is a tuple of segments: plain `str` is text (tokenized with special-token strings
split, so source code that mentions `<|im_end|>` stays text), `Mark` is one special token.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata as metadata
import io
import random
import re
import sys
import sysconfig
import textwrap
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from portcullis import DISTRIBUTION

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)

# Test suites and generated tables (codec maps, unicode data) teach little about how Python reads.
SKIP_DIRS = frozenset(
    {"test", "tests", "testing", "idlelib", "turtledemo", "lib2to3", "encodings", "site-packages",
     "dist-packages", "__pycache__", "ensurepip", "_vendor", "vendored", "benchmarks"}
)
MAX_FILE_BYTES = 80_000  # larger files are mostly generated (tables, lexers, stubs)
# Without a cap torch, transformers and sympy would be two thirds of the data, much of it
# near-copies (transformers' per-model files); a cap per package keeps the mix broad.
PACKAGE_BUDGET_BYTES = 1_500_000
PROJECT = DISTRIBUTION


class Mark(str):
    """A special token inside a document."""


Doc = tuple[str, ...]  # str segments are text, Mark segments special tokens


@dataclass(frozen=True)
class SourceFile:
    origin: str  # "stdlib" or the distribution's name
    path: str  # relative to its root, '/'-separated
    text: str


def _skipped(parts: Sequence[str]) -> bool:
    return bool(SKIP_DIRS & set(parts)) or parts[-1].startswith("test_")


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a few files use legacy encodings; skipping them keeps the data UTF-8


def stdlib_files() -> list[SourceFile]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not _skipped(rel.parts) and (text := _read(p)) is not None:
            found.append(SourceFile("stdlib", rel.as_posix(), text))
    return found


def project_requirements() -> list[str]:
    """This project's runtime dependencies, the engine extra's included, as pyproject.toml pins
    them (the installed metadata can be older than the file), or as installed where the file is
    not beside the package."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if sys.version_info >= (3, 11) and pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text())["project"]
        return [*project["dependencies"], *project["optional-dependencies"]["engine"]]
    return [r.split(";")[0] for r in metadata.requires(PROJECT) or [] if "extra" not in r or '"engine"' in r]


def dependency_closure(requirements: Sequence[str]) -> list[metadata.Distribution]:
    """The installed distributions the requirements pull in, transitively, sorted by name (a
    requirement behind `extra == "x"` counts only where something asked for extra x)."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key, extras = re.sub(r"[-_.]+", "-", req.name).lower(), tuple(sorted(req.extras))
        if (key, extras) in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add((key, extras))
        try:
            found[key] = dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this machine does not have
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *extras)):
                sub.marker = None  # settled here
                todo.append(sub)
    return [found[k] for k in sorted(found) if k != PROJECT]


def dependency_files(dist: metadata.Distribution) -> list[SourceFile]:
    """Up to PACKAGE_BUDGET_BYTES of a distribution's .py files, picked in an order fixed by a
    hash of their paths (so the pick spreads over the package and is the same on every run)."""
    name = dist.metadata["Name"]
    paths = [f for f in dist.files or [] if f.suffix == ".py" and not _skipped(f.parts)]
    paths.sort(key=lambda f: hashlib.sha256(f.as_posix().encode()).hexdigest())
    picked, used = [], 0
    for f in paths:
        text = _read(Path(dist.locate_file(f)))
        if text is None or used + len(text) > PACKAGE_BUDGET_BYTES:
            continue
        picked.append(SourceFile(name, f.as_posix(), text))
        used += len(text)
    return picked


def source_files() -> list[SourceFile]:
    """Standard library + dependencies, de-duplicated by content, sorted by origin and path."""
    files = stdlib_files()
    for dist in dependency_closure(project_requirements()):
        files += dependency_files(dist)
    files.sort(key=lambda f: (f.origin != "stdlib", f.origin.lower(), f.path))
    seen: set[str] = set()
    unique = []
    for f in files:
        digest = hashlib.sha256(f.text.encode()).hexdigest()
        if digest not in seen and f.text.strip():
            seen.add(digest)
            unique.append(SourceFile(f.origin, f.path, trim_docstrings(f.text)))
    return unique


_OPENING = re.compile(r"""([rRuU]?)(\"\"\"|\'\'\')""")


def trim_docstrings(text: str) -> str:
    """Multi-line docstrings cut to their first paragraph. Library docstrings run to dozens of
    lines (parameters, examples); a model this small learns to write them forever after a
    `def` line instead of a body. The text must still parse, or it is returned unchanged."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return text
    docs = [node.body[0] for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str) and node.body[0].end_lineno > node.body[0].lineno]
    lines = text.splitlines(keepends=True)
    for doc in sorted(docs, key=lambda n: n.lineno, reverse=True):
        start, end, col = doc.lineno - 1, doc.end_lineno, doc.col_offset
        trimmed = _first_paragraph("".join(lines[start:end]), col)
        if trimmed is not None:
            lines[start:end] = [trimmed]
    out = "".join(lines)
    try:
        ast.parse(out)
    except (SyntaxError, ValueError):
        return text
    return out


def _first_paragraph(source: str, col: int) -> str | None:
    """A docstring's lines (`source`, opening quotes at column `col`) with only its first
    paragraph kept, or None to keep it whole."""
    opening = _OPENING.match(source, col)
    if opening is None or source[:col].strip():
        return None
    quote = opening.group(2)
    close = source.rfind(quote)
    body, rest = source[opening.end():close], source[close + 3:]
    kept: list[str] = []
    for line in body.split("\n"):
        if not line.strip() and any(k.strip() for k in kept):
            break
        kept.append(line)
    short = "\n".join(kept).rstrip()
    if short == body.rstrip() or not short.strip() or short.endswith(("\\", quote[0])):
        return None
    closing = "\n" + source[:col] if "\n" in short else ""
    return source[:col] + opening.group(0) + short + closing + quote + rest


def split_files(files: list[SourceFile], every: int, held_out: Sequence[str]) -> tuple[list, list]:
    """Every `every`-th file is validation; a file that contains a held-out test prompt is
    dropped from training (it goes to validation), so the test measures unseen prompts."""
    train, val = [], []
    for i, f in enumerate(files):
        contains_prompt = any(p in f.text for p in held_out)
        (val if i % every == every - 1 or contains_prompt else train).append(f)
    return train, val


# --- documents shaped like requests -------------------------------------------------------------

MAX_ANSWER_CHARS = 900  # an answer must fit a 256-token training window with its question
MAX_EDIT_CHARS = 420  # the function appears twice in an edit example
SYSTEM = "You are a helpful coding assistant."
NEW_NAMES = ("value", "item", "result", "data", "text", "count", "total", "node", "entry", "size")


def chat(user: str, answer: str, rng: random.Random) -> Doc:
    system = (Mark(IM_START), f"system\n{SYSTEM}", Mark(IM_END), "\n") if rng.random() < 0.3 else ()
    return (*system, Mark(IM_START), f"user\n{user}", Mark(IM_END), "\n",
            Mark(IM_START), f"assistant\n{answer}", Mark(IM_END), "\n")


def functions(text: str) -> Iterator[tuple[ast.FunctionDef, str]]:
    """Undecorated functions of a module (methods too) with their dedented source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines(keepends=True)  # once: ast.get_source_segment re-splits per call
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.decorator_list and node.end_lineno:
            yield node, textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip()


# Summaries that start with these words describe rather than ask ("This method is deprecated").
NOT_VERBS = frozenset(
    "this the a an it its if for in on when deprecated helper internal private called used see "
    "note alias same like override overrides wrapper shortcut test tests todo implementation "
    "default base abstract utility function method class decorator context generator callback "
    "hook legacy backwards compatibility compat fixme xxx hack dummy".split()
)


def as_request(summary: str) -> str | None:
    """'Return the sum of x.' -> 'returns the sum of x', or None for a line unfit to ask."""
    summary = summary.strip().rstrip(".")
    words = summary.split()
    if not 3 <= len(words) <= 20 or not words[0].isalpha() or not words[0][0].isupper():
        return None
    verb = words[0].lower()
    if verb in NOT_VERBS:
        return None
    if not verb.endswith("s"):
        if verb.endswith("y") and verb[-2:-1] not in "aeiou":
            verb = verb[:-1] + "ies"
        elif verb.endswith(("sh", "ch", "x", "z", "o")):
            verb += "es"
        else:
            verb += "s"
    return " ".join([verb, *words[1:]])


def instruction_example(node: ast.FunctionDef, source: str, rng: random.Random) -> Doc | None:
    doc = ast.get_docstring(node)
    # The first sentence of the first paragraph: a summary line may wrap onto the next line.
    summary = " ".join(doc.split("\n\n")[0].split()).split(". ")[0] if doc else ""
    request = as_request(summary) if summary else None
    if request is None or len(source) > MAX_ANSWER_CHARS or len(node.body) < 2:
        return None
    return chat(f"Write a Python function that {request}", f"```python\n{source}\n```", rng)


def rename(source: str, old: str, new: str) -> str | None:
    """`source` with every name token `old` replaced by `new` (strings and comments untouched)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    out = [t._replace(string=new) if t.type == tokenize.NAME and t.string == old else t for t in tokens]
    return tokenize.untokenize(out)


def edit_example(node: ast.FunctionDef, source: str, rng: random.Random) -> Doc | None:
    """'Rename x to y in this function' with the whole edited function as the answer: IDE
    edit requests, and practice at copying text through (what speculative decoding rewards)."""
    if len(source) > MAX_EDIT_CHARS:
        return None
    args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    candidates = sorted(a for a in args if a in names)
    if not candidates:
        return None
    old = rng.choice(candidates)
    new = rng.choice([n for n in NEW_NAMES if n not in names and n not in args] or ["renamed"])
    edited = rename(source, old, new)
    if edited is None or edited == source:
        return None
    user = f"Rename `{old}` to `{new}` in this function:\n```python\n{source}\n```"
    return chat(user, f"```python\n{edited}\n```", rng)


def fim_example(text: str, rng: random.Random) -> Doc | None:
    """Prefix, suffix, middle as Qwen2.5-Coder's PSM: a hole of part of a line up to a few
    lines, with up to ~12 lines of context on each side (a whole file would not fit a window)."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 6:
        return None
    start = rng.randrange(1, len(lines) - 2)
    end = min(len(lines), start + rng.choice((1, 1, 2, 3, 5)))
    cut = rng.randrange(len(lines[start]) // 2 + 1)  # half the holes start mid-line
    before = "".join(lines[max(0, start - 12):start]) + lines[start][:cut]
    middle = lines[start][cut:] + "".join(lines[start + 1:end])
    after = "".join(lines[end:end + rng.randrange(0, 12)])
    if not middle.strip() or len(before) + len(middle) + len(after) > MAX_ANSWER_CHARS:
        return None
    # The stream's EOS after each document ends the middle, as Qwen2.5-Coder's does.
    return (Mark(FIM_PREFIX), before, Mark(FIM_SUFFIX), after, Mark(FIM_MIDDLE), middle)


def shaped_documents(
    files: Sequence[SourceFile], seed: int, instruct_share: float, fim_per_file: int
) -> dict[str, list[Doc]]:
    """Chat and FIM documents made from training files only (validation stays unseen)."""
    rng = random.Random(seed)
    made: dict[str, list[Doc]] = {"instruct": [], "edit": [], "fim": []}
    for f in files:
        made["fim"] += filter(None, (fim_example(f.text, rng) for _ in range(fim_per_file)))
        for node, source in functions(f.text):
            if rng.random() < instruct_share and (doc := instruction_example(node, source, rng)):
                made["instruct"].append(doc)
            elif rng.random() < 0.25 and (doc := edit_example(node, source, rng)):
                made["edit"].append(doc)
    return made
