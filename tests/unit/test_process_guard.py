"""The suite's process guard (``tests/process_guard.py``) on a pytest run of its own: a test that leaves a process
running errors and the process is killed; a module fixture's process may outlive each test but not the module;
a test that ends its processes, and one whose process takes a moment to exit, pass."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import alive

REPO = Path(__file__).resolve().parents[2]

CONFTEST = """
import tests.process_guard as guard
guard.GRACE_S = 1.0
from tests.process_guard import pytest_configure, pytest_fixture_post_finalizer, pytest_fixture_setup
from tests.process_guard import pytest_runtest_teardown
"""

TESTS = """
import os, signal, subprocess, time
from pathlib import Path
import pytest

PIDS = Path(os.environ["PIDS"])

def note(name, proc):
    with PIDS.open("a") as f:
        f.write(f"{name} {proc.pid}\\n")

@pytest.fixture(scope="module")
def kept():
    proc = subprocess.Popen(["sleep", "600"])
    note("kept", proc)
    yield proc
    proc.kill()
    proc.wait()

@pytest.fixture(scope="module")
def forgotten():
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    note("forgotten", proc)
    yield proc

def test_a_module_process_outlives_the_test(kept):
    assert kept.poll() is None

def test_it_is_still_there(kept):
    assert kept.poll() is None

def test_leaks():
    note("leaked", subprocess.Popen(["sleep", "600"], start_new_session=True))

def test_ends_its_process():
    proc = subprocess.Popen(["sleep", "600"])
    proc.terminate()
    proc.wait()

def test_exits_within_the_grace():
    note("slow", subprocess.Popen(["sleep", "0.3"]))

def test_grandchild_of_a_dead_parent_is_found():
    cmd = ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    with PIDS.open("a") as f:
        f.write(f"orphan {int(out.stdout)}\\n")

def test_last_uses_the_forgotten_fixture(forgotten):
    assert forgotten.poll() is None
"""


def test_the_guard_errors_on_leftovers_kills_them_and_spares_fixtures(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(TESTS))
    pids = tmp_path / "pids.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIDS": str(pids)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", str(tmp_path / "test_leaky.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "PASSED test_leaky.py::test_a_module_process_outlives_the_test" in out
    assert "PASSED test_leaky.py::test_it_is_still_there" in out
    assert "ERROR test_leaky.py::test_leaks" in out
    assert "PASSED test_leaky.py::test_ends_its_process" in out
    assert "PASSED test_leaky.py::test_exits_within_the_grace" in out
    assert "ERROR test_leaky.py::test_grandchild_of_a_dead_parent_is_found" in out
    assert "ERROR test_leaky.py::test_last_uses_the_forgotten_fixture" in out  # its module fixture left one
    assert "still ran 1 s after the test ended (now killed)" in out and "sleep 600" in out
    noted = dict(line.split() for line in pids.read_text().splitlines())
    assert set(noted) == {"kept", "forgotten", "leaked", "slow", "orphan"}
    assert not [name for name, pid in noted.items() if alive(int(pid))], out
