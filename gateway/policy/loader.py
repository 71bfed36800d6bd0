"""Read the policy YAML (and its keys file) into a validated `LoadedPolicy`.

Every failure becomes a `PolicyError` naming the file, the line and the reason, because the
person reading it is an admin who just saved a file and needs to know where to look.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.policy.models import KeyRecord, KeysFile, Policy


class PolicyError(Exception):
    """An invalid policy: `str()` is `file:line: reason`, ready for a log line or a terminal."""

    def __init__(self, path: Path | str, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
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


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(path, None, f"cannot read: {exc.strerror or exc}") from None
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise PolicyError(path, line, f"YAML error: {getattr(exc, 'problem', None) or exc}") from None
    finally:
        loader.dispose()
    return data, node


def _line_for(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Follow a pydantic error location down the YAML node tree to the nearest line."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        node, line = child, child.start_mark.line + 1
    return line


def _child(node: yaml.Node | None, part: Any) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.value == str(part):
                return value_node
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]
    return None


def _validate(model: type, data: Any, path: Path, node: yaml.Node | None) -> Any:
    if not isinstance(data, dict):
        raise PolicyError(path, 1, "the file must be a YAML mapping")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        where = ".".join(str(p) for p in loc) or "(top level)"
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            reason = "unknown field"
        raise PolicyError(path, _line_for(node, loc), f"{where}: {reason}") from None


def _keys_file_with_node(path: Path) -> tuple[KeysFile, yaml.Node | None]:
    if not path.exists():
        return KeysFile(), None
    data, node = _parse_yaml(path)
    return _validate(KeysFile, data if data is not None else {}, path, node), node


def load_keys_file(path: Path) -> KeysFile:
    return _keys_file_with_node(path)[0]


@dataclass(frozen=True)
class _KeySource:
    records: list[KeyRecord]
    path: Path
    node: yaml.Node | None


def _merge_keys(policy: Policy, sources: list[_KeySource]) -> dict[str, KeyRecord]:
    merged: dict[str, KeyRecord] = {}
    for source in sources:
        for index, record in enumerate(source.records):
            line = _line_for(source.node, ("keys", index, "id"))
            problem = _key_problem(policy, merged, record)
            if problem:
                raise PolicyError(source.path, line, f"keys.{index}: {problem}")
            merged[record.id] = record
    return merged


def _key_problem(policy: Policy, merged: dict[str, KeyRecord], record: KeyRecord) -> str | None:
    if record.id in merged:
        return f"duplicate key id {record.id!r}"
    if record.tenant not in policy.tenants:
        return f"key {record.id!r} names unknown tenant {record.tenant!r}"
    rule = policy.principals.get(record.principal)
    if rule is not None and rule.tenant != record.tenant:
        return f"key {record.id!r}: principal {record.principal!r} belongs to tenant {rule.tenant!r}"
    return None


def load_policy(path: Path | str) -> LoadedPolicy:
    """Parse and validate the policy and its keys file, or raise `PolicyError`."""
    path = Path(path)
    data, node = _parse_yaml(path)
    policy: Policy = _validate(Policy, data, path, node)
    keys_path = resolve_relative(path, policy.keys_file) if policy.keys_file else None
    sources = [_KeySource(policy.keys, path, node)]
    if keys_path is not None:
        keys_file, keys_node = _keys_file_with_node(keys_path)
        sources.append(_KeySource(keys_file.keys, keys_path, keys_node))
    keys = _merge_keys(policy, sources)
    sources = (path,) + ((keys_path,) if keys_path else ())
    return LoadedPolicy(policy=policy, path=path, keys=keys, sources=sources)


def resolve_relative(policy_path: Path, other: str) -> Path:
    """Paths inside the policy are relative to the policy file, not to the working directory."""
    candidate = Path(other)
    return candidate if candidate.is_absolute() else policy_path.parent / candidate
