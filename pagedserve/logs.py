"""Structured logging shared by every pagedserve process: one key=value (or JSON) line per event."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None, json: bool | None = None) -> None:
    """Routes structlog to stderr with a timestamp and the service name on every line.

    `PAGEDSERVE_LOG_LEVEL` (default info) and `PAGEDSERVE_LOG_FORMAT=json` override the defaults.
    """
    level = (level or os.environ.get("PAGEDSERVE_LOG_LEVEL", "info")).upper()
    if json is None:
        json = os.environ.get("PAGEDSERVE_LOG_FORMAT", "console") == "json"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
