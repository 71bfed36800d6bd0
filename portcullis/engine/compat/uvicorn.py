"""uvicorn's `Server.capture_signals`, overridden (it is not documented): `Server.serve` runs
inside it, and on leaving it uvicorn raises again each signal that stopped the server, so the
process would die of SIGTERM before `engine.server.run` removes its socket file. Pinned by
tests/engine/test_compat.py."""
from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn


class GracefulServer(uvicorn.Server):
    """SIGINT/SIGTERM start a graceful shutdown, after which the process exits normally."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (tests serve on a background one)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
