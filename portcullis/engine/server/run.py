"""Listening sockets and the uvicorn server around the app.

The Unix socket is bound here rather than by uvicorn, because uvicorn makes socket files
world-writable (0666). Its mode is set to 0600 after `bind()` but before `listen()`: until
`listen()` no one can connect, so there is no window in which the socket is open to others.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import threading
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from portcullis.engine.compat.uvicorn import GracefulServer

BACKLOG = 2048
MAX_HEAD_BYTES = 64 * 1024  # the gateway sends a few short headers


class ListenError(RuntimeError):
    """The server cannot listen where it was asked to; the message says why and what to do."""


def bind_unix_socket(path: Path) -> socket.socket:
    if not path.parent.exists():
        try:
            path.parent.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            raise ListenError(f"cannot create {path.parent} for the engine socket ({exc.strerror}); pass --uds PATH") from exc
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {path} ({exc.strerror}); pass --uds PATH") from exc
    return sock


def _remove_stale_socket(path: Path) -> None:
    """A socket file left by a server that died is removed; a live one, or any other file, is not."""
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ListenError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise ListenError(f"another server is already listening on {path}")


def bind_tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port} ({exc.strerror})") from exc


def uvicorn_server(app: FastAPI, log_level: str = "warning") -> uvicorn.Server:
    # Access logs off: the engine writes its own line per finished request. h11 rather than
    # httptools, which reads a request head of any size into memory before the token check.
    config = uvicorn.Config(app, log_level=log_level, access_log=False, ws="none", lifespan="on", server_header=False,
                            timeout_graceful_shutdown=5, http="h11", h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    return GracefulServer(config)


def serve(app: FastAPI, sock: socket.socket, log_level: str = "warning", engine=None) -> None:
    """Serve until SIGINT/SIGTERM, or until `engine` (an AsyncEngine) dies of an internal
    error; the socket file (if any) is removed afterwards."""
    path = sock.getsockname() if sock.family == socket.AF_UNIX else None
    server = uvicorn_server(app, log_level)
    if engine is not None:
        # A dead engine loop cannot come back in this process. Exiting lets a supervisor
        # (portcullis serve, systemd, Kubernetes) start a fresh one, where staying up would
        # answer 503 forever. In-flight requests have been told; the shutdown is graceful.
        engine.on_dead = lambda _error: setattr(server, "should_exit", True)
    try:
        if engine is None:
            asyncio.run(server.serve(sockets=[sock]))
        else:
            _serve_beside_engine(server, sock, engine)
    finally:
        sock.close()
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _serve_beside_engine(server: uvicorn.Server, sock: socket.socket, engine) -> None:
    """The engine's step loop on this (the main) thread, the server's event loop on another:
    OpenMP keeps its workers spinning only for a main-thread master (`AsyncEngine`'s docstring),
    for a bounded time (`portcullis.engine.openmp`, set where the engine process starts).
    SIGINT/SIGTERM, handled here, start the server's graceful shutdown, which stops the engine."""
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="engine-server")
    on_main = threading.current_thread() is threading.main_thread()  # not so in tests
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        engine.run_on_this_thread(thread.start, thread.is_alive)
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ServerThread:
    """The server on a background thread with its own event loop (tests, benchmarks)."""

    def __init__(self, app: FastAPI, sock: socket.socket):
        self.sock = sock
        self.server = uvicorn_server(app)
        self._thread = threading.Thread(target=self._run, name="engine-server", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self.error = exc

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        waited = 0.0
        while not self.server.started:
            if not self._thread.is_alive() or waited > timeout_s:
                raise RuntimeError(f"the engine server did not start: {self.error!r}")
            self._thread.join(0.02)
            waited += 0.02
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.sock.close()
