"""Where log records go: every record to the process's JSON-lines file; on ``tether up``'s console (``console_lines``)
only warnings and errors, one ``tether:`` line each, and not the ones the console printed in its own words."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.logs import get_logger, setup_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def _emit() -> None:
    log = get_logger("tether.test")
    log.info("embedded_redis_started", port=6379)
    log.warning("child_died_restarting", child="learner", code=1)
    log.warning("run_warning", message="no step for 60 s")
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("child_failed", child="rollout-0")


def test_up_console_shows_tether_lines_and_the_file_keeps_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    setup_logging(process="up", log_file=tmp_path / "up.log", console_lines=True)
    _emit()
    err = capsys.readouterr().err.splitlines()
    assert err == ["tether: warning: child_died_restarting child=learner code=1"]  # errors: the run's own line
    events = [json.loads(line)["event"] for line in (tmp_path / "up.log").read_text().splitlines()]
    assert events == ["embedded_redis_started", "child_died_restarting", "run_warning", "child_failed"]


def test_other_processes_keep_structured_console_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    setup_logging(process="learner", log_file=tmp_path / "learner.log")
    _emit()
    err = capsys.readouterr().err
    assert "embedded_redis_started" in err and "run_warning" in err and "tether: warning:" not in err
