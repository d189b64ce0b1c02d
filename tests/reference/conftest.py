"""The reference suite's fixtures: verl's and TRL's own code, imported, or a clear reason why not.

Where a reference cannot be imported the suite fails when ``$CI`` is set (CI installs both with
``make install-test``: a reference suite that silently skips there checks nothing) and skips with that
reason elsewhere.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.reference._verl import load_verl

T = TypeVar("T")
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def require(what: str, load: Callable[[], T]) -> T:
    try:
        return load()
    except (ImportError, RuntimeError) as exc:
        reason = f"{what}: {exc} — `make install-test` installs it (tests/reference)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI is set, so the reference suite must run", pytrace=False)
        pytest.skip(reason)


def trl_pin() -> str:
    """The TRL version pyproject.toml's ``bench`` extra pins (the one pin the ``reference`` extra reuses)."""
    extras = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for req in extras["bench"]:
        if req.startswith("trl=="):
            return req.split("==", 1)[1]
    raise RuntimeError("pyproject.toml: the bench extra pins no trl==VERSION")


def load_trl() -> types.ModuleType:
    want = trl_pin()
    try:
        have = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"trl is not installed (the reference suite needs trl=={want})") from None
    if have != want:
        raise RuntimeError(f"trl {have} is installed; the reference suite compares against trl=={want}")
    return importlib.import_module("trl")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per quantity compared: the largest abs difference to the reference over all its checks."""
    from tests.reference.inputs import RECORDED

    worst: dict[tuple[str, str, str], tuple[float, int]] = {}
    for what, reference, dtype, diff in RECORDED:
        key = (what, reference, dtype)
        top, n = worst.get(key, (0.0, 0))
        worst[key] = (max(top, diff) if diff == diff else top, n + 1)  # NaN: shapes differed, the check failed
    if not worst:
        return
    terminalreporter.section("tether vs the reference: largest abs difference")
    for (what, reference, dtype), (top, n) in sorted(worst.items()):
        terminalreporter.write_line(f"{top:9.2e}  {what} vs {reference} ({dtype}, {n} checks)")


@pytest.fixture(scope="session")
def verl() -> types.SimpleNamespace:
    """verl's ``core_algos`` & co. (:func:`tests.reference._verl.load_verl`)."""
    return require("verl", load_verl)


@pytest.fixture(scope="session")
def trl() -> types.ModuleType:
    return require("trl", load_trl)
