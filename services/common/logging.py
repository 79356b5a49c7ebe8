"""structlog set-up shared by every process: console for a person, JSON with --log-json.

Log lines carry identifiers and sizes only: never prompt text, never KV bytes.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(
    json_logs: bool = False, service: str = "", level: int = logging.INFO
) -> None:
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
