"""`portcullis gateway`: the public gateway in front of one engine or a fleet, under uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from portcullis.cli.arguments import fail
from portcullis.gateway.policy.loader import PolicyError, load_policy, resolve_relative
from portcullis.gateway.telemetry import add_tracing_flag
from portcullis.gateway.tls import add_tls_flags, tls_problem, uvicorn_tls_options
from portcullis.protocol.channel import DEFAULT_ENGINE_URL, ENGINE_TOKEN_ENV

TLS_FIELDS = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs")


def _engine_token(args: argparse.Namespace) -> str | None:
    if args.engine_token_file:
        return Path(args.engine_token_file).read_text().strip()
    return os.environ.get(ENGINE_TOKEN_ENV)


def cmd_gateway(args: argparse.Namespace) -> int:
    from portcullis.gateway.settings import GatewaySettings

    token = _engine_token(args)
    if not token:
        return fail(f"no engine token: pass --engine-token-file or set {ENGINE_TOKEN_ENV}", 2)
    try:
        settings = GatewaySettings(host=args.host, port=args.port, policy=Path(args.policy),
                                   engine_url=args.engine_url, engine_token=token, workers=args.workers,
                                   forwarded_allow_ips=args.forwarded_allow_ips,
                                   audit_keyring=Path(args.audit_keyring) if args.audit_keyring else None,
                                   **{field: getattr(args, field) for field in CONNECTION_FLAGS},
                                   **{field: getattr(args, field) for field in TLS_FIELDS},
                                   otlp_traces_endpoint=args.otlp_traces_endpoint, audit_syslog=args.audit_syslog)
    except ValidationError as exc:
        problems = "; ".join(f"{_setting_name(e['loc'])}: {e['msg']}" for e in exc.errors())
        return fail(f"refusing to start: {problems}", 2)
    try:
        loaded = load_policy(settings.policy)
    except PolicyError as exc:
        return fail(f"refusing to start: {exc}", 2)
    problem = _audit_keyring_problem(settings, loaded) or tls_problem(settings)
    if settings.otlp_traces_endpoint and not problem:
        from portcullis.gateway.telemetry import tracing_problem

        problem = tracing_problem()
    if problem:
        return fail(f"refusing to start: {problem}", 2)
    if settings.workers > 1 and loaded.policy.rate_limits.storage.startswith("memory://"):
        print(f"portcullis: warning: rate limits are kept per worker with memory:// storage, so each of "
              f"the {settings.workers} workers allows the full limit; set rate_limits.storage to a "
              "redis:// URL to share them", file=sys.stderr)
    _serve(settings, token)
    return 0


def _audit_keyring_problem(settings: Any, loaded: Any) -> str | None:
    """Load (or on first start create) the audit keyring before any worker starts, so every
    worker finds it, and a keyring the gateway cannot use stops it here with a clear message."""
    from portcullis.gateway.audit.keys import (
        AuditKeyring,
        KeyringError,
        check_outside,
        keyring_path,
    )

    path = keyring_path(settings.audit_keyring, settings.policy)
    try:
        AuditKeyring.load_or_create(path)
        check_outside(path, resolve_relative(loaded.path, loaded.policy.audit.path))
    except KeyringError as exc:
        return str(exc)
    except OSError as exc:
        return (f"cannot create the audit keyring {path} ({exc.strerror}); create it where it can be "
                "written (`portcullis audit init-keyring FILE`), mount it read-only and pass --audit-keyring")
    return None


def _setting_name(loc: tuple[Any, ...]) -> str:
    """The flag that sets a settings field, so the message says what to change."""
    name = ".".join(map(str, loc))
    if name in CONNECTION_FLAGS:
        return CONNECTION_FLAGS[name][0]
    return "--engine-token-file" if name == "engine_token" else "--" + name.replace("_", "-")


def _serve(settings: Any, token: str) -> None:
    import uvicorn

    from portcullis.gateway.app import SETTINGS_ENV, create_app
    from portcullis.gateway.metrics import metrics_shared_by_workers
    from portcullis.oplog import configure_logging

    configure_logging(force=True)
    proxied = settings.forwarded_allow_ips is not None
    common = dict(host=settings.host, port=settings.port, log_level="warning", access_log=False,
                  server_header=False, proxy_headers=proxied, timeout_graceful_shutdown=30,
                  **_connection_options(settings), **uvicorn_tls_options(settings))
    if proxied:
        common["forwarded_allow_ips"] = settings.forwarded_allow_ips
    if settings.workers == 1:
        uvicorn.run(create_app(settings), **common)
        return
    # Worker processes rebuild the app from the environment (uvicorn needs an import string).
    os.environ[SETTINGS_ENV] = settings.model_dump_json(exclude={"engine_token"})
    os.environ[ENGINE_TOKEN_ENV] = token
    config = uvicorn.Config("portcullis.gateway.app:create_app_from_env", factory=True, workers=settings.workers, **common)
    with metrics_shared_by_workers():
        _run_workers(config)


def _connection_options(settings: Any) -> dict[str, Any]:
    """h11 (httptools buffers a request head of any size) with the limits of gateway/connection.py.

    A partial, not a closure: worker processes receive the config pickled.
    """
    from functools import partial

    from portcullis.gateway.connection import ConnectionLimits, GuardedH11Protocol

    limits = ConnectionLimits(settings.timeout_header_s, settings.timeout_body_s, settings.timeout_send_s,
                              settings.limit_concurrency, settings.h11_max_incomplete_event_size)
    return dict(http=partial(GuardedH11Protocol, limits=limits), timeout_keep_alive=settings.timeout_keep_alive_s,
                h11_max_incomplete_event_size=settings.h11_max_incomplete_event_size)


def _run_workers(config: Any) -> None:
    """uvicorn's multi-worker mode, with TCP_NODELAY on the shared listening socket.

    uvicorn binds that socket itself with protocol 0, so asyncio never turns Nagle off on the
    connections it accepts: a response written as head then body then waits for the
    client's delayed ACK, adding about 40 ms to every keep-alive request. Linux copies
    TCP_NODELAY from a listening socket to each accepted one, so setting it once fixes all.
    """
    import inspect
    import socket

    import uvicorn
    from uvicorn.supervisors import Multiprocess

    sock = config.bind_socket()
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if "target" in inspect.signature(Multiprocess).parameters:  # uvicorn < 0.30
        Multiprocess(config, target=uvicorn.Server(config).run, sockets=[sock]).run()
    else:
        Multiprocess(config, sockets=[sock]).run()


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run the gateway in front of an engine")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--policy", required=True, help="policy YAML (edits apply within 2 s; check them first "
                   "with `portcullis policy check`)")
    p.add_argument("--engine-url", default=DEFAULT_ENGINE_URL,
                   help="unix:///path/to/sock or http://host:port (private network only)")
    p.add_argument("--engine-token-file", help=f"file with the internal token (else env {ENGINE_TOKEN_ENV})")
    p.add_argument("--workers", type=int, default=1, help="worker processes (share limits via Redis)")
    p.add_argument("--forwarded-allow-ips", help="comma-separated addresses of trusted reverse proxies; "
                   "only their X-Forwarded-For sets the client address (default: trust none)")
    p.add_argument("--audit-keyring", help="the audit keyring (HMAC and signing keys), outside the audit log's "
                   "folder; created on first start (default: $PORTCULLIS_AUDIT_KEYRING, else "
                   "secrets/audit-keyring.json beside the policy)")
    _connection_flags(p)
    add_tls_flags(p)
    add_tracing_flag(p)
    p.add_argument("--audit-syslog", metavar="URL", help="also send every audit line to syslog (RFC 5424, facility "
                   "log audit): udp://host:514 or unix:///dev/log")
    p.set_defaults(func=cmd_gateway)


# Settings field -> (flag, type, help); uvicorn's flag names where uvicorn has the setting.
CONNECTION_FLAGS = {
    "timeout_header_s": ("--timeout-header", float, "seconds a client has to send a request head"),
    "timeout_body_s": ("--timeout-body", float, "seconds a client has to send a request body after its head"),
    "timeout_send_s": ("--timeout-send", float, "seconds a response may wait for a client that stopped reading"),
    "timeout_keep_alive_s": ("--timeout-keep-alive", float, "seconds an idle connection stays open"),
    "limit_concurrency": ("--limit-concurrency", int, "connections or requests at once; more get 503"),
    "h11_max_incomplete_event_size": ("--h11-max-incomplete-event-size", int,
                                      "largest request head in bytes; larger ones get 431"),
}


def _connection_flags(parser: argparse.ArgumentParser) -> None:
    from portcullis.gateway.settings import GatewaySettings

    for field, (flag, kind, text) in CONNECTION_FLAGS.items():
        default = GatewaySettings.model_fields[field].default
        metavar = {"--limit-concurrency": "N", "--h11-max-incomplete-event-size": "BYTES"}.get(flag, "SECONDS")
        parser.add_argument(flag, dest=field, type=kind, default=default, metavar=metavar,
                            help=f"{text} (default {default:g})")

