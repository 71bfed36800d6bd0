"""`portcullis serve --model A --model B:FLAGS [--replicas N]`: several engines behind one gateway.

One engine per model and replica, each on its own Unix socket in serve's private runtime
folder (0700, one fresh internal token), all behind one gateway whose policy is the user's
policy with an `upstreams:` section listing them (gateway.upstream.fleet balances and fails
over between replicas). Supervised as the single-model serve (`portcullis.supervisor.serve`): a dead engine
is restarted with backoff while its siblings keep serving, a dead gateway stops everything,
and SIGINT/SIGTERM ends every engine's process group, with PR_SET_PDEATHSIG as the backstop.

The gateway reads a generated copy of the policy, `.<policy name>.serve.yaml` beside it (so
`keys_file`, `audit.path` and other relative paths mean the same), refreshed whenever the
user's policy changes: edits still apply without a restart. The copy is the user's text with
the upstreams appended, so a line number in a policy error is the user's line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from portcullis.gateway.telemetry import tracing_argv
from portcullis.gateway.tls import tls_argv
from portcullis.protocol.engine_flags import read_shared_flags
from portcullis.supervisor.children import (
    GATEWAY_DRAIN_TIMEOUT_S,
    MAX_BACKOFF_S,
    Child,
    install_signal_handlers,
    log,
    wait_for_engine,
)

DEMO = "demo"  # `--model demo`: the engine's bundled demo model
UPSTREAMS_HEADER = "\n# ---- appended by `portcullis serve`: the engines it started (not in your policy file) ----\n"


@dataclass(frozen=True)
class ModelSpec:
    """One `--model MODEL[:ENGINE FLAGS]`: what to load, its flags, and the name(s) it answers to."""

    model: str | None  # None: the bundled demo model
    flags: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", self.names[0]).strip("-.")[:40] or "model"


def parse_model_spec(spec: str) -> ModelSpec:
    """`MODEL` or `MODEL:--flag=value --other ...` (flags split as a shell would). A path may hold
    ':'; the flags start at the first ':-'."""
    model, sep, rest = spec.partition(":-")
    flags = tuple(shlex.split("-" + rest)) if sep else ()
    if not model:
        raise ValueError(f"--model {spec!r}: give a model (a folder, a Hub id or 'demo') before the flags")
    names = served_names(flags) or (model,)
    return ModelSpec(None if model == DEMO else model, flags, names)


def served_names(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The names an engine given `flags` serves under, as it reads them; () when they name none."""
    return tuple(read_shared_flags(flags).served_model_name or ())


@dataclass
class EngineSlot:
    """One engine process of the fleet: its upstream name, socket and supervisor child."""

    name: str
    spec: ModelSpec
    sock: Path
    child: Child
    restart_at: float | None = None


def plan_engines(specs: list[ModelSpec], replicas: int, common: list[str], runtime: Path, token_file: Path,
                 python: str, env: dict[str, str]) -> list[EngineSlot]:
    """One engine per model and replica; later flags win, so a model's own flags override the
    common ones."""
    slots, used = [], set()
    for index, spec in enumerate(specs):
        for replica in range(1, replicas + 1):
            name = f"{spec.slug}-{replica}"
            if name in used:
                name = f"{spec.slug}-{index + 1}-{replica}"
            used.add(name)
            sock = runtime / f"e{index}-{replica}.sock"
            argv = [python, "-m", "portcullis.engine", *([spec.model] if spec.model else []), "--uds", str(sock),
                    "--token-file", str(token_file), *common, *spec.flags]
            if not served_names(spec.flags):
                argv += ["--served-model-name", *spec.names]
            slots.append(EngineSlot(name, spec, sock, Child(f"engine {name}", argv, env)))
    return slots


def upstreams_text(slots: list[EngineSlot]) -> str:
    """The policy's `upstreams:` for the fleet, in YAML's JSON-compatible flow style."""
    lines = ["upstreams:"]
    for slot in slots:
        entry = {"name": slot.name, "url": f"unix://{slot.sock}", "models": list(slot.spec.names)}
        lines.append(f"  - {json.dumps(entry)}")
    return "\n".join(lines) + "\n"


def generated_policy_path(policy: Path) -> Path:
    return policy.with_name(f".{policy.stem}.serve.yaml")


def write_generated_policy(policy: Path, upstreams: str) -> Path:
    """The user's policy text with the fleet's upstreams appended, replaced atomically."""
    target = generated_policy_path(policy)
    text = policy.read_text()
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text.rstrip("\n") + "\n" + UPSTREAMS_HEADER + upstreams)
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)
    return target


def policy_lists_upstreams(policy: Path) -> bool:
    return re.search(r"^upstreams\s*:", policy.read_text(), re.M) is not None


def run_fleet(args, specs: list[ModelSpec], common: list[str], policy: Path, runtime: Path, token_file: Path,
              env: dict[str, str], python: str, first_key: str | None, announce) -> int:
    if policy_lists_upstreams(policy):
        log(f"{policy} lists its own upstreams; with several --model serve writes them itself: remove "
            "the policy's `upstreams:` or run `portcullis gateway` with it instead")
        return 2
    slots = plan_engines(specs, args.replicas, common, runtime, token_file, python, env)
    upstreams = upstreams_text(slots)
    generated = write_generated_policy(policy, upstreams)
    gateway_argv = [python, "-m", "portcullis.cli", "gateway", "--host", args.host, "--port", str(args.port),
                    "--policy", str(generated), "--engine-url", f"unix://{slots[0].sock}",
                    "--engine-token-file", str(token_file)]
    if args.forwarded_allow_ips:
        gateway_argv += ["--forwarded-allow-ips", args.forwarded_allow_ips]
    gateway_argv += tls_argv(args) + tracing_argv(args)
    gateway = Child("gateway", gateway_argv, env)
    stopping = install_signal_handlers()
    try:
        for slot in slots:
            log(f"starting engine {slot.name} ({slot.spec.model or DEMO}, serving {', '.join(slot.spec.names)})")
            slot.child.start()
        for slot in slots:
            if not wait_for_engine(slot.child, slot.sock, stopping):
                _stop_engines(slots)
                return 1 if not stopping else 0
        gateway.start()
        names = list(dict.fromkeys(n for spec in specs for n in spec.names))
        log(f"{len(slots)} engines behind one gateway ({', '.join(s.name for s in slots)}); models: "
            f"{', '.join(names)}")
        announce(args, names[0], first_key, policy)
        code = _supervise_fleet(slots, gateway, policy, upstreams, stopping)
        gateway.stop(GATEWAY_DRAIN_TIMEOUT_S)
        _stop_engines(slots)
        log("stopped")
        return code
    finally:
        generated.unlink(missing_ok=True)


def _stop_engines(slots: list[EngineSlot], timeout: float = 30.0) -> None:
    """SIGTERM to every engine at once, then wait (each Child.stop escalates to its group's SIGKILL)."""
    for slot in slots:
        if slot.child.running():
            slot.child.proc.send_signal(15)
    for slot in slots:
        slot.child.stop(timeout)


def _supervise_fleet(slots: list[EngineSlot], gateway: Child, policy: Path, upstreams: str,
                     stopping: list[int]) -> int:
    """Until a signal: keep the generated policy in step with the user's, restart a dead engine
    with backoff (its replicas serve meanwhile; with none, the gateway answers 503); a dead
    gateway ends everything."""
    seen = _stamp(policy)
    while not stopping:
        time.sleep(0.2)
        if not gateway.running():
            log(f"the gateway exited with code {gateway.proc.returncode}; stopping the engines")
            return 1
        stamp = _stamp(policy)
        if stamp != seen and stamp is not None:
            seen = stamp
            write_generated_policy(policy, upstreams)
        for slot in slots:
            _tend(slot)
    return 0


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _tend(slot: EngineSlot) -> None:
    child = slot.child
    if child.running():
        if time.monotonic() - child.started > 60:
            child.restarts = 0
        return
    if slot.restart_at is None:
        delay = min(MAX_BACKOFF_S, 2.0 ** child.restarts)
        log(f"engine {slot.name} exited with code {child.proc.returncode}; its replicas serve meanwhile; "
            f"restarting in {delay:.0f} s")
        slot.restart_at = time.monotonic() + delay
    elif time.monotonic() >= slot.restart_at:
        child.restarts += 1
        slot.restart_at = None
        slot.sock.unlink(missing_ok=True)
        child.start()
