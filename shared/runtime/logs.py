"""structlog setup: JSON lines when not on a terminal, pretty when on one."""

from __future__ import annotations

import logging
import sys

import structlog


class _Stderr:
    """Whatever ``sys.stderr`` is at each write (a test's capture, a redirect made after setup), never a
    stream that was closed since."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def setup(level: str = "info", json: bool | None = None) -> None:
    json = not sys.stderr.isatty() if json is None else json
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        cache_logger_on_first_use=False,
    )


def get(service: str, **context) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(service=service, **context)
