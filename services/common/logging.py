"""structlog set-up shared by every process: console for a person, JSON with --log-json.

Log lines carry identifiers and sizes only: never prompt text, never KV bytes.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LEVEL_ENV = "FLUIDPD_LOG_LEVEL"


def level_from_env(default: int = logging.INFO) -> int:
    """``$FLUIDPD_LOG_LEVEL`` (debug|info|warning|error, any case), else ``default``.
    Raises ValueError naming the variable on any other value."""
    raw = os.environ.get(LEVEL_ENV, "").strip().lower()
    if not raw:
        return default
    if raw not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={raw!r}: expected one of {', '.join(LEVELS)}")
    return LEVELS[raw]


def configure_logging(json_logs: bool = False, service: str = "", level: int | None = None) -> None:
    """Configure structlog and stdlib logging for this process (mutates global logging
    state; call once, first thing in a ``__main__``). ``level`` None: ``level_from_env()``
    (raises ValueError on a bad value)."""
    if level is None:
        level = level_from_env()
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    if service:
        processors.insert(0, lambda _l, _m, ev: {**ev, "service": service})
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(stream=sys.stderr, level=level, format="%(levelname)s %(name)s %(message)s")
