"""Operational logging for every process we start (not the audit log): one event per line on
stderr, JSON by default or plain console lines, configured here once for the gateway and the engine.

Tracebacks are rendered plainly on purpose: renderers that print each frame's local variables
would print API keys and the internal token held in those frames. Uvicorn keeps its own handlers
(its loggers do not propagate), so its lines are not doubled by the root handler set here.
"""

from __future__ import annotations

import logging
import sys

import structlog

FORMATS = ("json", "console")


def configure_logging(fmt: str = "json", force: bool = False) -> None:
    """Set up structlog (and the standard library's root logger, for libraries) once per process;
    a later call changes nothing unless `force` (a command line's own choice wins over an app's default)."""
    if structlog.is_configured() and not force:
        return
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    # httpx logs every request at INFO: the fleet's health checks and scrapes would be 4+ lines a second.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    renderer = (structlog.processors.JSONRenderer() if fmt == "json" else
                structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback))
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
