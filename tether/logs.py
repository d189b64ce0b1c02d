"""Structured logging for every process: readable console lines, JSON lines in the run folder.

``setup_logging(process="learner-rank0", level="info", log_file=paths.log_file("learner-rank0"))``
once at start-up; then ``log = get_logger(__name__)`` and ``log.info("weights_published", version=3)``.
Standard-library loggers (grpc, transformers, ...) go through the same handlers.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import structlog

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.StackInfoRenderer(),
]


def setup_logging(
    *,
    process: str,
    level: str = "info",
    console_format: str = "console",
    log_file: str | Path | None = None,
) -> None:
    """Route structlog and stdlib logging to stderr (console or JSON) and to a JSON-lines file."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(process=process)
    console_renderer: Any = (
        structlog.processors.JSONRenderer()
        if console_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(_formatter(console_renderer))
    root.addHandler(console)
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(_formatter(structlog.processors.JSONRenderer()))
        root.addHandler(file_handler)
    root.setLevel(level.upper())
    for noisy in ("urllib3", "filelock", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _route_structlog_through_stdlib() -> None:
    """Before ``setup_logging`` (library use, tests) records go to stdlib logging, never to stdout."""
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


_route_structlog_through_stdlib()


def _formatter(renderer: Any) -> structlog.stdlib.ProcessorFormatter:
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name)
