"""No test leaves a process behind: a pytest plugin (loaded by ``tests/conftest.py``).

Every process a test starts inherits ``$TETHER_TEST_SESSION`` (set here to this pytest process's own token),
however deep it sits under ``tether up``, torchrun, ``ip netns exec`` or a parent that has since died. After
each test's teardown the only such processes still running may be those of fixtures that outlive the test
(module or session scope: their processes are recorded while they are set up, and must be gone once they are
torn down). Anything else gets a grace period to finish exiting, is then SIGKILLed, and the test errors with
the leftovers' command lines, so a failed or sloppy test cannot load the rest of the suite.

A process started with an environment built from nothing escapes the check: pass ``{**os.environ, ...}``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

MARK = "TETHER_TEST_SESSION"
GRACE_S = 20.0
# Helpers the pytest process keeps for its own lifetime on purpose (Python's and torch's), not a test's leftovers.
INFRASTRUCTURE = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")

_token = f"{os.getpid()}-{time.time_ns()}"
_owned: dict[object, set[int]] = {}  # fixture definition -> pids it started while being set up


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent pid) from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return fields[0].decode(), int(fields[1])


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def marked_processes(*, settle: bool = False) -> dict[int, str]:
    """``{pid: command line}`` of the live processes (zombies excluded) that carry this session's mark.

    A process caught in the middle of ``exec`` shows an empty environment for a moment (its parent's ``Popen``
    may already have returned): with ``settle`` such processes are read again for up to a second."""
    needle = f"{MARK}={_token}".encode()
    found: dict[int, str] = {}
    unsettled: list[int] = []
    pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and int(e.name) != os.getpid()]
    for attempt in range(20 if settle else 1):
        for pid in pids:
            try:
                environ = _read(f"/proc/{pid}/environ")
                state, parent = _stat(pid)
                if not environ and parent not in (0, 2) and pid != 2:  # not a kernel thread
                    unsettled.append(pid)
                if state == "Z" or needle not in environ.split(b"\0"):
                    continue
                found[pid] = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        if not unsettled or attempt == 19:
            break
        pids, unsettled = unsettled, []
        time.sleep(0.05)
    return found


def _leftovers() -> dict[int, str]:
    allowed = set().union(*_owned.values()) if _owned else set()
    return {
        pid: cmd
        for pid, cmd in marked_processes().items()
        if pid not in allowed and not any(name in cmd for name in INFRASTRUCTURE)
    }


def _end(pids: dict[int, str]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pytest_configure(config: pytest.Config) -> None:
    # Each pytest process (an xdist worker too) marks its own children: a token inherited from a parent is replaced.
    os.environ[MARK] = _token


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[object]:
    if fixturedef.scope == "function":
        return (yield)
    before = set(marked_processes())
    try:
        return (yield)
    finally:
        _owned.setdefault(fixturedef, set()).update(set(marked_processes(settle=True)) - before)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> None:
    _owned.pop(fixturedef, None)  # torn down: what it started must now be gone like any test's processes


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    failure: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # the teardown's own error is reported as it is; the leftovers still end
        failure = exc
    left = _leftovers()
    deadline = time.monotonic() + GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _leftovers()
    _end(left)
    if failure is not None:
        raise failure
    if left:
        listing = "\n".join(f"  {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"{len(left)} process(es) still ran {GRACE_S:.0f} s after the test ended (now killed):\n{listing}")
