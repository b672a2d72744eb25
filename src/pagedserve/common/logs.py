"""Structured logging shared by every pagedserve process: one key=value (or JSON) line per event."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _Stderr:
    """Whatever sys.stderr is at each write: a process that configures logging in-process (e.g.
    `pagedserve bench --in-process` under pytest, whose captured stderr is swapped and closed
    between tests) keeps logging to the live stream, never to a closed one."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


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
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        # Not cached: a logger keeps the configuration of its first use when cached, and one
        # process may configure again (tests: an in-process `LLM` at warning, then capture_logs).
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
