"""`portcullis serve [MODEL]`: engine and gateway in one command, supervised.

The engine runs as `python -m portcullis.engine` on a Unix socket (mode 0600) inside a private runtime
directory (0700) with a fresh internal token; once it answers `/health`, the gateway starts on
the public address in front of it. The supervisor restarts a dead engine with backoff (the
gateway answers 503 meanwhile), stops everything on SIGINT/SIGTERM (gateway first, so it
drains), and every child dies with it even if it is killed outright (PR_SET_PDEATHSIG).
This module starts the engine as a program; it never imports it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

from portcullis import envs
from portcullis.gateway.telemetry import add_tracing_flag, tracing_argv
from portcullis.gateway.tls import add_tls_flags, tls_argv
from portcullis.protocol.engine_flags import read_shared_flags
from portcullis.supervisor.children import (
    GATEWAY_DRAIN_TIMEOUT_S,
    MAX_BACKOFF_S,
    Child,
    install_signal_handlers,
    log,
    wait_for_engine,
)

STARTER_POLICY = """\
# Portcullis policy written by `portcullis serve` on first run. Edit freely: changes apply
# within 2 s without a restart; check them with `portcullis policy check {path}`.
version: 1
routes:
  - {{method: POST, path: /v1/chat/completions}}
  - {{method: POST, path: /v1/completions}}
  - {{method: POST, path: /v1/messages}}               # Anthropic's Messages API (Claude Code, the Anthropic SDK)
  - {{method: POST, path: /v1/messages/count_tokens}}
  - {{method: POST, path: /v1/responses}}              # OpenAI's Responses API (Codex, the OpenAI Agents SDK)
  - {{method: POST, path: /v1/embeddings}}
  - {{method: GET,  path: /v1/models}}
  - {{method: POST, path: /tokenize}}
  - {{method: POST, path: /detokenize}}
  - {{method: GET,  path: /health}}
  - {{method: GET,  path: /metrics, scopes: [admin]}}
tenants:
  default:
    models: ["*"]
    # Sized for the engine's --max-num-seqs {max_num_seqs}: a benchmark at its full batch meets no 429.
    limits: {{requests_per_minute: {rpm}, tokens_per_minute: {tpm}, concurrent_requests: {concurrent}}}
keys_file: keys.yaml
audit:
  path: audit.log
"""

# Per engine slot: 4 requests/s and 500 tokens/s, above what one sequence of a small model
# does on a GPU, so the starter limits stop a runaway client, not a full-batch benchmark.
RPM_PER_SEQ, TPM_PER_SEQ = 240, 30_000
RUNTIME_PREFIX, PID_FILE = "portcullis-", "serve.pid"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="portcullis serve",
        description="Engine and gateway in one command: `portcullis serve [MODEL] [flags]`. MODEL is a local "
        "Hugging Face folder, GGUF file or Hub id (default: SmolLM2-135M-Instruct from the cache `make setup` "
        "fills, else the embedded demo model); flags not listed here "
        "(--max-model-len, --dtype, --tensor-parallel-size, ...) go to the engine.",
    )
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port (default 8000)")
    p.add_argument("--policy", help="policy YAML (default: policy.yaml in --home, written on first run)")
    p.add_argument("--home", help="where the starter policy, keys and audit log live "
                   "(default: $PORTCULLIS_HOME or ~/.portcullis)")
    p.add_argument("--forwarded-allow-ips", help="addresses of trusted reverse proxies (TLS terminated there)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: demo, or MODEL)")
    p.add_argument("--api-key", default=envs.VLLM_API_KEY.get() or None,
                   help="one static key, as vLLM's --api-key (default: $VLLM_API_KEY); stored hashed")
    p.add_argument("--model", action="append", dest="models", metavar="MODEL[:FLAGS]",
                   help="several models behind one gateway, one engine each (repeat the flag): a folder, a Hub "
                   "id or 'demo', then optionally its own engine flags after ':', e.g. "
                   "'PATH:--max-model-len=4096 --served-model-name=code'; other flags go to every engine")
    p.add_argument("--replicas", type=int, default=1, help="engines per model, balanced by the gateway (default 1)")
    add_tls_flags(p)  # given to the gateway
    add_tracing_flag(p)  # given to the gateway and every engine
    return p


# Agents send tool_choice "auto" (LangChain's and pydantic-ai's default): `serve` reads calls
# from replies out of the box, in the template's format or the generic one (`portcullis engine`
# keeps vLLM's default, off).
AUTO_TOOL_CHOICE = ["--enable-auto-tool-choice"]
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the default model's name in the API (as its card names it)


def default_model(served_name: str | None) -> tuple[str | None, str | None]:
    """With no model named: SmolLM2-135M-Instruct where `make setup` put its GGUF file in the
    cache, else (None: the engine's bundled demo model) the toy that works offline."""
    from portcullis.engine.assets import SMOLLM2, cached

    path = cached(SMOLLM2)
    if path is None:
        return None, served_name
    return str(path), served_name or DEFAULT_MODEL_NAME


def main(argv: list[str]) -> int:
    # MODEL is taken by hand: as an optional positional, argparse would swallow the value of an
    # engine flag it does not know (`--max-model-len 256` would make "256" the model).
    model = argv[0] if argv and not argv[0].startswith("-") else None
    args, engine_flags = build_parser().parse_known_args(argv[1:] if model else argv)
    args.model = model
    if args.model is None and not args.models:
        args.model, args.served_model_name = default_model(args.served_model_name)
    engine_flags += tracing_argv(args) + AUTO_TOOL_CHOICE
    specs, problem = _fleet_specs(args, engine_flags)
    if problem:
        log(problem)
        return 2
    _remove_abandoned_runtime_dirs()
    problem = _port_in_use(args.host, args.port)
    if problem:
        log(problem)
        return 2
    if not _is_loopback(args.host) and not args.forwarded_allow_ips and not args.ssl_certfile:
        log(f"warning: the gateway will listen on {args.host}, reachable from other machines; give it a "
            "certificate (--ssl-certfile, --ssl-keyfile) or put TLS in front of it (a reverse proxy, then "
            "--forwarded-allow-ips) before exposing it")
    if args.api_key is not None and len(args.api_key) < 16:
        log("--api-key / VLLM_API_KEY must be at least 16 characters; a short key can be guessed")
        return 2
    home = Path(args.home or envs.HOME.get() or Path.home() / ".portcullis").expanduser()
    policy = Path(args.policy).expanduser() if args.policy else home / "policy.yaml"
    first_key, batch = None, read_shared_flags(engine_flags).max_num_seqs * max(1, len(specs) * args.replicas)
    if not policy.exists():
        first_key = _first_run(policy, batch, admin_key=args.api_key is None)
        if first_key:  # now, not once the engine is up: an engine that fails must not strand the key
            _print_key(args, specs[0].names[0] if specs else args.served_model_name or args.model or "demo",
                       first_key, policy)
    else:
        for warning in _limits_below_batch(policy, batch):
            log(f"warning: {warning}")
    if args.api_key is not None:
        problem = _register_static_key(policy, args.api_key)
        if problem:
            log(problem)
            return 2
    runtime = _runtime_dir()
    try:
        if specs:
            return _run_fleet(args, specs, engine_flags, policy, runtime, first_key)
        return _run(args, engine_flags, policy, runtime, first_key)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _fleet_specs(args, engine_flags: list[str]) -> tuple[list, str | None]:
    """The models of a fleet serve (several --model, or --replicas > 1), or [] for the one-engine
    serve; one `--model X[:FLAGS]` is the same as `serve X [FLAGS]`."""
    from portcullis.supervisor.fleet import ModelSpec, parse_model_spec, served_names

    if args.replicas < 1:
        return [], "--replicas must be at least 1"
    try:
        specs = [parse_model_spec(spec) for spec in args.models or ()]
    except ValueError as exc:
        return [], str(exc)
    if specs and args.model:
        return [], f"give the model either as MODEL ({args.model}) or as --model, not both"
    if len(specs) <= 1 and args.replicas == 1:
        if specs:
            args.model = specs[0].model or None
            engine_flags.extend(specs[0].flags)
            if served_names(specs[0].flags):
                args.served_model_name = specs[0].names[0]
        return [], None
    if not specs:  # `serve [MODEL] --replicas N`: replicas of the one model, named as usual
        name = args.served_model_name or args.model or "demo"
        return [ModelSpec(args.model, (), (name,))], None
    if args.served_model_name:
        return [], "with several models, name each in its own flags: --model 'PATH:--served-model-name=NAME'"
    return specs, None


def _run_fleet(args, specs: list, engine_flags: list[str], policy: Path, runtime: Path, first_key: str | None) -> int:
    from portcullis.supervisor.fleet import run_fleet

    token_file = runtime / "engine-token"
    token_file.write_text(secrets.token_urlsafe(32))
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != envs.ENGINE_TOKEN.name}
    return run_fleet(args, specs, engine_flags, policy, runtime, token_file, env, sys.executable, first_key, _announce)


def _port_in_use(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port} ({exc.strerror}); is another server using it? pick another with --port"
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _remove_abandoned_runtime_dirs() -> None:
    """Remove the runtime folders (engine socket and token) of earlier serves that were killed
    outright (`kill -9` skips our clean-up); only ours, and only when their serve is gone."""
    for folder in _runtime_base().glob(f"{RUNTIME_PREFIX}*"):
        pid = _dead_owner(folder)
        if pid is not None:
            shutil.rmtree(folder, ignore_errors=True)
            log(f"removed {folder}, left by a serve (pid {pid}) that no longer runs")


def _runtime_base() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())


def _runtime_dir() -> Path:
    """A private folder (0700) for the engine's socket and token, marked with our pid."""
    runtime = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX, dir=_runtime_base()))
    (runtime / PID_FILE).write_text(f"{os.getpid()}\n")
    return runtime


def _dead_owner(folder: Path) -> int | None:
    """The pid of the serve that made `folder`, if the folder is ours (a real folder, not a link,
    of this user, with our pid file) and that process is gone; None leaves it alone."""
    try:
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return None
        pid = int((folder / PID_FILE).read_text())
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except (OSError, ValueError):  # no pid file, or the pid is someone else's process now
        return None
    return None


def starter_policy(path: Path, max_num_seqs: int) -> str:
    """The first-run policy, its tenant limits sized to the engine's batch (never below the
    limits it always had: 600 requests and 1M tokens a minute)."""
    return STARTER_POLICY.format(path=path, max_num_seqs=max_num_seqs, concurrent=max_num_seqs,
                                 rpm=max(600, RPM_PER_SEQ * max_num_seqs),
                                 tpm=max(1_000_000, TPM_PER_SEQ * max_num_seqs))


def _limits_below_batch(policy: Path, max_num_seqs: int) -> list[str]:
    """Tenants capped below the engine's batch (a policy from an earlier first run, say)."""
    from portcullis.gateway.policy.loader import PolicyError, load_policy

    try:
        loaded = load_policy(policy)
    except PolicyError:
        return []  # the gateway refuses to start, and says why
    found = []
    for name, tenant in loaded.policy.tenants.items():
        cap = tenant.limits.merged_over(loaded.policy.defaults).concurrent_requests
        if cap is not None and cap < max_num_seqs:
            found.append(f"tenant {name!r} allows {cap} concurrent requests, fewer than the engine's "
                         f"--max-num-seqs {max_num_seqs}, so a full batch gets 429; raise "
                         f"tenants.{name}.limits.concurrent_requests in {policy} if that is not meant")
    return found


def _first_run(policy: Path, max_num_seqs: int, admin_key: bool) -> str | None:
    """Write a starter policy and (unless a static key is given) a first admin key; return the
    key, which is shown once and never stored."""
    from portcullis.gateway.auth.keys import KeyBook, new_key

    policy.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    policy.write_text(starter_policy(policy, max_num_seqs))
    log(f"first run: wrote a starter policy to {policy}")
    if not admin_key:
        return None
    token, record = new_key("admin", "default", ["admin"], note="created by portcullis serve on first run")
    KeyBook(policy.parent / "keys.yaml").add(record)
    log("and an admin key (only its hash is stored)")
    return token


def _register_static_key(policy: Path, token: str) -> str | None:
    """Make sure the keys file holds the static key's record; a problem message otherwise."""
    from portcullis.gateway.auth.keys import KeyBook, new_static_key, static_key_id
    from portcullis.gateway.policy.loader import PolicyError, load_policy, resolve_relative

    try:
        loaded = load_policy(policy)
    except PolicyError as exc:
        return f"the policy is invalid: {exc}"
    if not loaded.policy.keys_file:
        return f"{policy} names no keys_file, so --api-key has nowhere to be stored; add `keys_file: keys.yaml`"
    if static_key_id(token) in loaded.keys:
        return None
    tenant = "default" if "default" in loaded.policy.tenants else next(iter(loaded.policy.tenants))
    KeyBook(resolve_relative(loaded.path, loaded.policy.keys_file)).add(new_static_key(token, "api-key", tenant, []))
    log(f"registered the static API key for tenant {tenant!r} (only its hash is stored)")
    return None


def _run(args, engine_flags: list[str], policy: Path, runtime: Path, first_key: str | None) -> int:
    sock, token_file = runtime / "engine.sock", runtime / "engine-token"
    token_file.write_text(secrets.token_urlsafe(32))
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != envs.ENGINE_TOKEN.name}
    served = args.served_model_name or (args.model or "demo")
    engine_argv = [sys.executable, "-m", "portcullis.engine", *([args.model] if args.model else []), "--uds", str(sock),
                   "--token-file", str(token_file), "--served-model-name", served, *engine_flags]
    engine = Child("engine", engine_argv, env)
    gateway_argv = [sys.executable, "-m", "portcullis.cli", "gateway", "--host", args.host, "--port", str(args.port),
                    "--policy", str(policy), "--engine-url", f"unix://{sock}", "--engine-token-file", str(token_file)]
    if args.forwarded_allow_ips:
        gateway_argv += ["--forwarded-allow-ips", args.forwarded_allow_ips]
    gateway_argv += tls_argv(args) + tracing_argv(args)
    gateway = Child("gateway", gateway_argv, env)
    stopping = install_signal_handlers()
    engine.start()
    if not wait_for_engine(engine, sock, stopping):
        engine.stop(10)
        return 1 if not stopping else 0
    gateway.start()
    _announce(args, served, first_key, policy)
    code = _supervise(engine, gateway, sock, stopping)
    gateway.stop(GATEWAY_DRAIN_TIMEOUT_S)
    engine.stop(30)
    log("stopped")
    return code


def _supervise(engine: Child, gateway: Child, sock: Path, stopping: list[int]) -> int:
    """Until a signal: restart a dead engine with backoff; a dead gateway ends everything."""
    restart_at = None
    while not stopping:
        time.sleep(0.2)
        if not gateway.running():
            log(f"the gateway exited with code {gateway.proc.returncode}; stopping the engine")
            return 1
        if engine.running():
            if time.monotonic() - engine.started > 60:
                engine.restarts = 0  # a long healthy run resets the backoff
            continue
        if restart_at is None:
            delay = min(MAX_BACKOFF_S, 2.0 ** engine.restarts)
            log(f"the engine exited with code {engine.proc.returncode}; the gateway answers 503 until it is "
                f"back; restarting in {delay:.0f} s")
            restart_at = time.monotonic() + delay
        elif time.monotonic() >= restart_at:
            engine.restarts += 1
            restart_at = None
            sock.unlink(missing_ok=True)
            engine.start()
    return 0


def _base_url(args) -> str:
    scheme = "https" if args.ssl_certfile else "http"
    return f"{scheme}://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"


def _keys_command(policy: Path, tenant: str = "default") -> str:
    return f"{_program()} keys --policy {shlex.quote(str(policy))} create --principal NAME --tenant {tenant}"


def _program() -> str:
    """`portcullis` as this shell can run it: the bare name where PATH finds this install's
    command, else its path (a virtualenv that was not activated, as after `make setup`)."""
    ours, found = Path(sys.executable).parent / "portcullis", shutil.which("portcullis")
    if not ours.exists() or (found is not None and Path(found).resolve() == ours.resolve()):
        return "portcullis"
    return shlex.quote(str(ours))


def _print_key(args, served: str, key: str, policy: Path) -> None:
    """The first run's admin key, with a request to try it; printed once, as soon as it is made."""
    base = _base_url(args)
    lines = [
        "",
        "Your admin API key (shown only this once; keep it somewhere safe):",
        "",
        f"    {key}",
        "",
        "Try it once the model is served (`serving ...` below):",
        f"    curl {base}/v1/chat/completions -H 'Authorization: Bearer {key}' \\",
        f"      -H 'Content-Type: application/json' -d '{{\"model\": \"{served}\", \"max_tokens\": 32, "
        "\"messages\": [{\"role\": \"user\", \"content\": \"def fibonacci(n):\"}]}'",
        "",
        "    from openai import OpenAI",
        f"    client = OpenAI(base_url=\"{base}/v1\", api_key=\"{key}\")",
        f"    print(client.completions.create(model=\"{served}\", prompt=\"def fibonacci(n):\", "
        "max_tokens=32).choices[0].text)",
        "",
        f"More keys: {_keys_command(policy)}",
        "",
    ]
    for line in lines:
        print(line, flush=True)


def _announce(args, served: str, first_key: str | None, policy: Path) -> None:
    lines = [f"serving {served!r} at {_base_url(args)}/v1 (engine on a private socket, gateway in front)"]
    if first_key:
        lines.append("Use the admin API key printed above.")
    elif args.api_key is None:  # the first run's key was shown once: say how to make another
        lines.append(f"Need an API key? {_keys_command(policy, _a_tenant(policy))}")
    if not args.model:  # the bundled demo model: say so before someone judges the engine by it
        lines += ["", "The demo model is a toy (a few million parameters trained on a CPU): its Python may parse but "
                  "seldom works. Serve a real model with: portcullis serve Qwen/Qwen2.5-Coder-1.5B-Instruct "
                  "(or a local Hugging Face folder: portcullis serve ./my-model)"]
    for line in lines:
        print(line, flush=True)


def _a_tenant(policy: Path) -> str:
    """A tenant of the policy for the hint: the starter's `default` where there is one."""
    from portcullis.gateway.policy.loader import PolicyError, load_policy

    try:
        tenants = list(load_policy(policy).policy.tenants)
    except PolicyError:
        return "default"
    return "default" if "default" in tenants or not tenants else tenants[0]
