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
    console_lines: bool = False,
) -> None:
    """Route structlog and stdlib logging to stderr (console or JSON) and to a JSON-lines file.

    ``console_lines`` (``tether up``, whose console is its progress lines and summary): with the ``console``
    format, stderr gets warnings only, each one ``tether: warning: <event> key=value ...`` line (a failure is
    the run's own ``tether: error:`` line); everything is in the log file. Events the console already printed
    in its own words (:data:`SHOWN_ON_CONSOLE`) are not repeated."""
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
    if console_lines and console_format != "json":
        console.setLevel(logging.WARNING)  # errors: the run's ending prints its own ``tether: error:`` line
        console.addFilter(lambda r: r.levelno == logging.WARNING and _event(r) not in SHOWN_ON_CONSOLE)
        console_renderer = _tether_line
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


SHOWN_ON_CONSOLE = frozenset({"run_warning"})
"""Events ``tether up``'s console prints in its own words (``tether: warning: ...``), kept out of its log lines."""


def _event(record: logging.LogRecord) -> str | None:
    return record.msg.get("event") if isinstance(record.msg, dict) else None


def _tether_line(_logger: Any, _name: str, event_dict: dict[str, Any]) -> str:
    """``tether: warning: child_died_restarting child=learner code=1 in_s=2``: one line, no timestamp."""
    level = event_dict.pop("level", "warning")
    event = event_dict.pop("event", "")
    for key in ("timestamp", "logger", "process"):
        event_dict.pop(key, None)
    fields = " ".join(f"{k}={v}" for k, v in event_dict.items() if k != "exception")
    line = f"tether: {level}: {event}" + (f" {fields}" if fields else "")
    return line + (f"\n{event_dict['exception']}" if "exception" in event_dict else "")


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
