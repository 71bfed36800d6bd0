"""Read the policy YAML (and its keys file) into a validated `LoadedPolicy`.

Every failure becomes a `PolicyError` naming the file, the line and the reason, because the
person reading it is an admin who just saved a file and needs to know where to look.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from portcullis.gateway.policy.models import KeyRecord, KeysFile, Policy

# mtime, ctime (a chmod that makes a file readable again), size, inode (a save by rename)
Stamp = tuple[int, int, int, int]
MISSING: Stamp = (0, 0, -1, 0)


def stamp(path: Path) -> Stamp:
    """What a file looks like on disk now (following symlinks, as a ConfigMap update needs)."""
    try:
        return _stamp_of(os.stat(path))
    except OSError:
        return MISSING


def _stamp_of(st: os.stat_result) -> Stamp:
    return st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino


@dataclass(frozen=True)
class SourceFile:
    """A file as one load read it. The stamp comes from the open file, before its bytes are
    read, so a write that lands during a (slow) load still differs from it on the next look."""

    path: Path
    stamp: Stamp
    digest: str = ""  # SHA-256 of the bytes parsed; "" when the file could not be read


class PolicyError(Exception):
    """An invalid policy: `str()` is `file:line: reason`, ready for a log line or a terminal."""

    def __init__(self, path: Path | str, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        self.reads: tuple[SourceFile, ...] = ()  # the files the refused load read
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True, eq=False)
class LoadedPolicy:
    """A policy that passed every check, with its keys merged and indexed by id.

    Compared and hashed by identity, so per-policy caches key on the snapshot itself.
    """

    policy: Policy
    path: Path
    keys: dict[str, KeyRecord]
    sources: tuple[Path, ...] = field(default=())
    reads: tuple[SourceFile, ...] = field(default=())


class _NoDuplicateKeys:
    """Refuses duplicate mapping keys (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "a key must be a plain name, not a list or mapping", key_node.start_mark
                )
            key = self.construct_object(key_node, deep=deep)  # type: ignore[attr-defined]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}; keep one of them", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _StrictLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """The pure-Python parser: its error messages are the ones `_yaml_problem` explains."""


# libyaml's parser is about 6x faster on a 3,000-key file; without it, the Python one.
_FastLoader: type = type("_FastLoader", (_NoDuplicateKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)), {})


MAX_FILE_BYTES = 64 * 1024 * 1024  # some 200,000 keys; anything larger is a wrong file, not a policy


def _read_text(path: Path, reads: list[SourceFile]) -> str:
    try:
        with open(path, "rb") as handle:
            st = os.fstat(handle.fileno())
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        reads.append(SourceFile(path, stamp(path)))
        raise PolicyError(path, None, f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        reads.append(SourceFile(path, _stamp_of(st)))
        raise PolicyError(path, None, f"larger than {MAX_FILE_BYTES >> 20} MiB: is this the right file?")
    digest = hashlib.sha256(raw).hexdigest()
    reads.append(SourceFile(path, _stamp_of(st), digest))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(path, None, f"not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None


# The nodes of a parsed file (for error lines), made only when an error needs a line.
Nodes = Callable[[], "yaml.Node | None"]


def _parse_yaml(path: Path, reads: list[SourceFile]) -> tuple[Any, Nodes]:
    text = _read_text(path, reads)
    data = _parse_json(text)
    if data is not None:
        return data, functools.cache(lambda: _compose(_StrictLoader, text)[1])
    try:
        data, node = _compose(_FastLoader, text)
    except yaml.YAMLError:  # parse again with the Python parser, for its clearer messages (or its verdict)
        try:
            data, node = _compose(_StrictLoader, text)
        except yaml.YAMLError as exc:
            line, reason = _yaml_problem(exc)
            raise PolicyError(path, line, f"YAML error: {reason}") from None
    return data, lambda: node


def _compose(loader_class: type, text: str) -> tuple[Any, yaml.Node | None]:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        return (loader.construct_document(node) if node is not None else None), node
    finally:
        loader.dispose()


_LEADING_COMMENTS = re.compile(r"\A(?:[ \t]*#[^\n]*\n)*")


def _parse_json(text: str) -> Any | None:
    """A file in YAML's JSON-compatible flow style (as `portcullis keys` writes the keys file),
    read with the JSON parser: a 3,000-key file in milliseconds instead of a second. None for
    anything else, or anything JSON and YAML could read differently; YAML reads those."""
    body = _LEADING_COMMENTS.sub("", text, count=1)
    if not body.startswith("{"):
        return None
    try:
        return json.loads(body, object_pairs_hook=_unique_pairs, parse_constant=_not_plain)
    except (ValueError, RecursionError):  # not plain JSON (a hand edit?), or a duplicate key: YAML says where
        return None


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        raise ValueError("duplicate key")
    return mapping


def _not_plain(constant: str) -> Any:
    raise ValueError(constant)  # NaN, Infinity: JSON extensions YAML reads as text


# What usually causes PyYAML's terser complaints, and what to do about it.
_YAML_HINTS = (
    ("'\\t'", "indent with spaces: YAML does not allow tabs"),
    ("expected <block end>", "check the indentation here and just above: the keys of one mapping "
                             "start in the same column"),
    ("mapping values are not allowed", "check the indentation, or quote a value that contains ': '"),
    ("another document", "a policy is one YAML document: remove the '---' line"),
    ("special characters are not allowed", "the file holds a control character; remove it"),
)
_UNCLOSED = {"while parsing a flow mapping": "'{'", "while parsing a flow sequence": "'['",
             "while scanning a quoted scalar": "quote"}


def _yaml_problem(exc: yaml.YAMLError) -> tuple[int | None, str]:
    """The line to look at and a reason an admin can act on."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark else None
    problem = (getattr(exc, "problem", None) or str(exc)).replace("'<stream end>'", "the end of the file")
    if isinstance(exc, yaml.reader.ReaderError):
        line, problem = None, str(exc).split("\n")[0]
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    opener = _UNCLOSED.get(context or "")
    if opener and context_mark is not None:
        # The mistake is where the bracket or quote opened, not where PyYAML gave up.
        return context_mark.line + 1, f"the {opener} opened on this line is not closed ({problem} at line {line})"
    hint = next((h for needle, h in _YAML_HINTS if needle in problem or needle in (context or "")), None)
    return line, f"{problem}; {hint}" if hint else problem


def _line_for(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Follow a pydantic error location down the YAML node tree to the nearest line
    (a mapping entry's key line, so an admin lands on the name they typed)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        line, node = child
    return line


def _child(node: yaml.Node | None, part: Any) -> tuple[int, yaml.Node] | None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.value == str(part):
                return key_node.start_mark.line + 1, value_node
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        item = node.value[part]
        return item.start_mark.line + 1, item
    return None


def _validate(model: type, data: Any, path: Path, nodes: Nodes) -> Any:
    if not isinstance(data, dict):
        raise PolicyError(path, 1, "the file must be a YAML mapping (`name: value` lines)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        problem = err.get("ctx", {}).get("error")
        loc += getattr(problem, "loc", ())
        raise PolicyError(path, _line_for(nodes(), loc), _reason(model, err, loc)) from None


def _reason(model: type, err: Any, loc: tuple[Any, ...]) -> str:
    where = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{where}: {_unknown_field(model, loc)}"
    if err["type"] == "missing":
        parent = ".".join(str(p) for p in loc[:-1]) or "(top level)"
        return f"{parent}: missing required field {loc[-1]!r}"
    reason = err["msg"].removeprefix("Value error, ")
    given = err.get("input")
    if isinstance(given, str) and "@" in given:  # a URL's user:password@ never reaches a log
        given = "…@" + given.rsplit("@", 1)[1]
    if isinstance(given, (str, int, float, bool)) and loc[-1:] != ("hash",):
        reason += f" (got {given!r:.60})"
    return f"{where}: {reason}"


def _unknown_field(model: type, loc: tuple[Any, ...]) -> str:
    known = _fields_at(model, loc[:-1])
    if not known:
        return "unknown field"
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean {close[0]!r}?"
    return f"unknown field; expected one of: {', '.join(known)} (or is it indented under the wrong key?)"


def _fields_at(model: type, loc: tuple[Any, ...]) -> list[str]:
    """The field names the schema allows at `loc` (dict keys and list indexes are stepped over)."""
    current: Any = model
    for part in loc:
        if _is_model(current) and part in current.model_fields:
            current = current.model_fields[part].annotation
        elif typing.get_origin(current) in (list, dict):
            current = typing.get_args(current)[-1]
        else:
            return []
        current = _without_none(current)
    return list(current.model_fields) if _is_model(current) else []


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _without_none(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1 else annotation


def _keys_file_with_node(path: Path, reads: list[SourceFile]) -> tuple[KeysFile, Nodes]:
    if not path.exists():
        reads.append(SourceFile(path, MISSING))
        return KeysFile(), lambda: None
    data, nodes = _parse_yaml(path, reads)
    data = data if data is not None else {}
    try:
        return KeysFile.model_validate(_with_known_records(data)), nodes
    except (ValidationError, TypeError):
        return _validate(KeysFile, data, path, nodes), nodes  # again, for the error's line and reason


def load_keys_file(path: Path) -> KeysFile:
    return _keys_file_with_node(path, [])[0]


class _RecordCache:
    """Key records of the last keys file read, by their parsed YAML: a reload (a revocation,
    say) validates only the records that changed, one at a time, so a 3,000-key file costs
    milliseconds of validation and never holds the interpreter long enough to stall requests."""

    def __init__(self) -> None:
        self.records: dict[Any, KeyRecord] = {}

    def validate(self, items: list[Any]) -> list[KeyRecord]:
        known, fresh, records = self.records, {}, []
        for item in items:
            frozen = _frozen(item)
            record = fresh.get(frozen) or known.get(frozen) or KeyRecord.model_validate(item)
            fresh[frozen] = record
            records.append(record)
        self.records = fresh  # replaced whole: what the file no longer holds is let go
        return records


def _frozen(value: Any) -> Any:
    """A hashable copy that tells apart what validation would (`1`, `1.0`, `True`, `"1"`)."""
    if isinstance(value, dict):
        return dict, tuple((_frozen(k), _frozen(v)) for k, v in value.items())
    if isinstance(value, list):
        return list, tuple(_frozen(v) for v in value)
    hash(value)  # TypeError for anything else unhashable: validated the slow way
    return type(value), value


_RECORDS = _RecordCache()


def _with_known_records(data: Any) -> Any:
    if isinstance(data, dict) and isinstance(data.get("keys"), list):
        return {**data, "keys": _RECORDS.validate(data["keys"])}
    return data


@dataclass(frozen=True)
class _KeySource:
    records: list[KeyRecord]
    path: Path
    nodes: Nodes


def _merge_keys(policy: Policy, sources: list[_KeySource]) -> dict[str, KeyRecord]:
    merged: dict[str, KeyRecord] = {}
    for source in sources:
        for index, record in enumerate(source.records):
            problem = key_problem(policy, merged, record)
            if problem:
                line = _line_for(source.nodes(), ("keys", index, "id"))
                raise PolicyError(source.path, line, f"keys.{index}: {problem}")
            merged[record.id] = record
    return merged


def key_problem(policy: Policy, merged: dict[str, KeyRecord], record: KeyRecord) -> str | None:
    """Why `record` cannot join `policy` next to the keys in `merged`, or None."""
    if record.id in merged:
        return f"duplicate key id {record.id!r}; keep only one of the records with this id"
    if record.tenant not in policy.tenants:
        return (f"key {record.id!r} names tenant {record.tenant!r}, which the policy does not define "
                f"(defined: {', '.join(policy.tenants)})")
    rule = policy.principals.get(record.principal)
    if rule is not None and rule.tenant != record.tenant:
        return (f"key {record.id!r}: principal {record.principal!r} belongs to tenant {rule.tenant!r} "
                f"in the policy's principals:, not to {record.tenant!r}")
    return None


def load_policy(path: Path | str) -> LoadedPolicy:
    """Parse and validate the policy and its keys file, or raise `PolicyError` (whose `reads`
    say which files it read, so a watcher knows what to look at for the fix)."""
    reads: list[SourceFile] = []
    try:
        return _load_policy(Path(path), reads)
    except PolicyError as exc:
        exc.reads = tuple(reads)
        raise


def reload_keys(loaded: LoadedPolicy) -> LoadedPolicy:
    """`loaded`'s policy with its keys file read again (or `PolicyError`): how a revocation
    still applies while an edit of the policy file itself is refused."""
    reads = [read for read in loaded.reads if read.path == loaded.path]
    return _with_keys(loaded.policy, loaded.path, lambda: None, reads)


def _load_policy(path: Path, reads: list[SourceFile]) -> LoadedPolicy:
    data, nodes = _parse_yaml(path, reads)
    return _with_keys(_validate(Policy, data, path, nodes), path, nodes, reads)


def _with_keys(policy: Policy, path: Path, nodes: Nodes, reads: list[SourceFile]) -> LoadedPolicy:
    keys_path = resolve_relative(path, policy.keys_file) if policy.keys_file else None
    sources = [_KeySource(policy.keys, path, nodes)]
    if keys_path is not None:
        keys_file, keys_nodes = _keys_file_with_node(keys_path, reads)
        sources.append(_KeySource(keys_file.keys, keys_path, keys_nodes))
    keys = _merge_keys(policy, sources)
    sources = (path,) + ((keys_path,) if keys_path else ())
    return LoadedPolicy(policy=policy, path=path, keys=keys, sources=sources, reads=tuple(reads))


def resolve_relative(policy_path: Path, other: str) -> Path:
    """Paths inside the policy are relative to the policy file, not to the working directory."""
    candidate = Path(other)
    return candidate if candidate.is_absolute() else policy_path.parent / candidate
