"""``make test-gpu``'s verdict (a pytest plugin: ``-p tests.gpu.verdict``): on a machine with CUDA, a GPU run
in which no test passed has failed — a suite that skips everything must not read as green there.

It also prints one line per GPU test — passed, failed or skipped and why — so the log of a lent GPU
machine says exactly what ran.
"""

from __future__ import annotations

import pytest

_outcomes: list[tuple[str, str, str]] = []  # (test id, outcome, skip reason)


def verdict(*, cuda: bool, passed: int, failed: int, dry_run: bool = False) -> tuple[int, str]:
    """``(exit status, message)`` for a GPU run: no CUDA — skips are expected; CUDA but nothing passed — fail."""
    if failed:
        return 1, f"{failed} GPU test(s) failed"
    if dry_run:
        return 0, f"dry run on the CPU (TETHER_GPU_SUITE_ON_CPU=1): {passed} passed — this says nothing about CUDA"
    if cuda and passed == 0:
        return 1, "CUDA is present but no GPU test ran: the suite was skipped or not collected (check the markers)"
    if not cuda:
        return 0, "no CUDA device: every GPU test was skipped (see the reasons above)"
    return 0, f"{passed} GPU test(s) passed"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        _outcomes.append((report.nodeid, report.outcome, reason))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import torch

    from tests.gpu.helpers import ON_CPU

    passed = sum(1 for _, o, _ in _outcomes if o == "passed")
    failed = sum(1 for _, o, _ in _outcomes if o == "failed")
    code, message = verdict(cuda=torch.cuda.is_available(), passed=passed, failed=failed, dry_run=ON_CPU)
    lines = [f"  {o:<7} {nodeid}" + (f"  ({reason})" if reason else "") for nodeid, o, reason in _outcomes]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "GPU suite")
        for line in lines:
            reporter.write_line(line)
        reporter.write_line(f"gpu verdict: {message}")
    if code and session.exitstatus in (0, 5):
        session.exitstatus = code
