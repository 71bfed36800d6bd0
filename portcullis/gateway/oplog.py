"""Operational logging (not the audit log): JSON lines on stderr, no local variables.

Tracebacks are rendered plainly on purpose: pretty renderers that print each frame's locals
would print API keys and tokens held in those frames.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(force: bool = False) -> None:
    if structlog.is_configured() and not force:
        return
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    # httpx logs every request at INFO: the fleet's health checks and scrapes would be 4+ lines a second.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
