"""The supervisor behind ``tether up``: children stop together, failures are reported, nothing orphaned."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.helpers import alive, wait_gone
from tether.commands.supervisor import ChildFailed, ChildSpec, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# a child that starts a grandchild in its own process group, like torchrun's ranks
FORKER = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    " print(p.pid, flush=True); time.sleep(600)",
]


def read_pid(path: Path, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return int(text.splitlines()[0])
        time.sleep(0.05)
    raise AssertionError(f"no pid in {path}")


def test_primary_success_then_stop_all(tmp_path: Path) -> None:
    sup = Supervisor(grace_s=5)
    worker = sup.start(ChildSpec("worker", SLEEPER, tmp_path / "worker.log"))
    sup.start(ChildSpec("main", [sys.executable, "-c", "print('done')"], tmp_path / "main.log", primary=True))
    assert sup.wait() == 0
    sup.stop_all()
    assert wait_gone(worker.proc.pid)
    assert "done" in (tmp_path / "main.log").read_text()


def test_failed_child_is_reported_with_its_log(tmp_path: Path) -> None:
    sup = Supervisor(grace_s=5)
    other = sup.start(ChildSpec("other", SLEEPER, tmp_path / "other.log"))
    sup.start(ChildSpec("bad", [sys.executable, "-c", "import sys; print('kaput'); sys.exit(3)"], tmp_path / "bad.log"))
    with pytest.raises(ChildFailed) as info:
        sup.wait()
    assert info.value.name == "bad" and info.value.code == 3
    assert "kaput" in str(info.value)
    sup.stop_all()
    assert wait_gone(other.proc.pid)


def test_grandchildren_are_stopped_too(tmp_path: Path) -> None:
    sup = Supervisor(grace_s=2)
    child = sup.start(ChildSpec("forker", FORKER, tmp_path / "forker.log"))
    grandchild = read_pid(tmp_path / "forker.log")
    assert alive(grandchild)
    sup.stop_all()
    assert wait_gone(child.proc.pid) and wait_gone(grandchild)


def test_stubborn_child_is_killed_after_grace(tmp_path: Path) -> None:
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
        "time.sleep(600)",
    ]
    sup = Supervisor(grace_s=1)
    child = sup.start(ChildSpec("stubborn", stubborn, tmp_path / "s.log"))
    deadline = time.monotonic() + 20
    while "ready" not in (tmp_path / "s.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.stop_all()
    assert wait_gone(child.proc.pid)


def test_a_dying_child_is_restarted_until_the_limit(tmp_path: Path) -> None:
    """Dies twice (a counter file says which life it is), then stays up: two restarts, the run goes on; the
    primary's restart command (the learner's ``--resume``) is used for it."""
    counter = tmp_path / "lives"
    flaky = [sys.executable, "-c", f"import pathlib, sys, time; p = pathlib.Path({str(counter)!r}); "
             "n = int(p.read_text() or 0) if p.exists() else 0; p.write_text(str(n + 1)); "
             "sys.exit(9) if n < 2 else time.sleep(600)"]  # fmt: skip
    sup = Supervisor(grace_s=5, max_restarts=3, backoff_s=0.05)
    server = sup.start(ChildSpec("server", flaky, tmp_path / "server.log", restartable=True))
    marker = tmp_path / "resumed"
    main = [sys.executable, "-c", "import sys; sys.exit(5)"]
    resumed = [sys.executable, "-c", f"import pathlib, time; time.sleep(1.5); pathlib.Path({str(marker)!r}).touch()"]
    sup.start(ChildSpec("main", main, tmp_path / "main.log", primary=True, restartable=True, restart_cmd=resumed))
    assert sup.wait() == 0  # the primary came back through its restart command and finished
    assert marker.exists()
    assert counter.read_text() == "3" and server.restarts == 2 and alive(server.proc.pid)
    assert sorted(name for name, _ in sup.restarts) == ["main", "server", "server"]
    sup.stop_all()
    assert wait_gone(server.proc.pid)


def test_a_child_that_keeps_dying_ends_the_run_with_the_reason(tmp_path: Path) -> None:
    sup = Supervisor(grace_s=5, max_restarts=2, backoff_s=0.05)
    sup.start(ChildSpec("bad", [sys.executable, "-c", "import sys; sys.exit(7)"], tmp_path / "bad.log",
                        restartable=True))  # fmt: skip
    with pytest.raises(ChildFailed) as info:
        sup.wait()
    assert info.value.name == "bad" and info.value.code == 7 and info.value.restarts == 2
    assert "run.max_restarts" in str(info.value)
    sup.stop_all()


def test_a_child_that_gave_up_is_not_restarted_and_its_reason_ends_the_run(tmp_path: Path) -> None:
    """The learner says a restart cannot help (a dataset that does not fit, a run that cannot train): the run
    ends at once with its reason, not after ``max_restarts`` lives that fail the same way."""
    reason = tmp_path / "gave_up.txt"
    lives = tmp_path / "lives"
    learner = [sys.executable, "-c", f"import pathlib, sys; l = pathlib.Path({str(lives)!r}); "
               "l.write_text(l.read_text() + 'x' if l.exists() else 'x'); "
               f"pathlib.Path({str(reason)!r}).write_text('the run cannot train: check rollout.max_prompt_len'); "
               "sys.exit(1)"]  # fmt: skip
    sup = Supervisor(grace_s=5, max_restarts=3, backoff_s=0.05)
    sup.start(ChildSpec("learner", learner, tmp_path / "learner.log", primary=True, restartable=True,
                        gave_up=lambda: reason.read_text() if reason.exists() else None))  # fmt: skip
    with pytest.raises(ChildFailed) as info:
        sup.wait()
    assert info.value.reason == "the run cannot train: check rollout.max_prompt_len" and info.value.restarts == 0
    assert "rollout.max_prompt_len" in str(info.value) and lives.read_text() == "x"
    sup.stop_all()


def _life_script(lives: Path, body: str) -> list[str]:
    """A child that counts its lives in ``lives`` and then runs ``body`` (``n`` is this life's number, from 0)."""
    return [sys.executable, "-c", f"import pathlib, sys, time; l = pathlib.Path({str(lives)!r}); "
            "n = len(l.read_text()) if l.exists() else 0; l.write_text('x' * (n + 1)); " + body]  # fmt: skip


def _steps(path: Path):  # the progress a test child reports: the file's text, as the learner's last step
    return lambda: path.read_text() if path.exists() else ""


def test_a_child_that_fails_at_start_the_same_way_twice_is_not_started_a_third_time(tmp_path: Path) -> None:
    """A learner whose model cannot load: the first death may be bad luck, the second one the same (a different
    pid and address in the message) is not; the run ends after two lives, not ``1 + max_restarts``."""
    lives, steps = tmp_path / "lives", tmp_path / "steps"
    body = ("raise RuntimeError(f'model.attn_implementation: flash_attention_2 needs a GPU (pid {12345 + n}, "
            "at 0x7f{n}a2c); use sdpa on CPU')")  # fmt: skip
    sup = Supervisor(grace_s=5, max_restarts=3, backoff_s=0.05)
    sup.start(ChildSpec("learner", _life_script(lives, body), tmp_path / "learner.out", primary=True,
                        restartable=True, progress=_steps(steps)))  # fmt: skip
    with pytest.raises(ChildFailed) as info:
        sup.wait()
    assert lives.read_text() == "xx" and info.value.repeated and info.value.restarts == 1
    assert info.value.error.startswith("RuntimeError: model.attn_implementation: flash_attention_2 needs a GPU")
    assert "not started again" in str(info.value) and "Traceback" not in str(info.value)
    sup.stop_all()


def test_a_child_that_got_going_keeps_the_restart_policy(tmp_path: Path) -> None:
    """The same error every time, but each life made a step first: a crash mid-run may not come back, so every
    restart of ``run.max_restarts`` is made."""
    lives, steps = tmp_path / "lives", tmp_path / "steps"
    body = f"pathlib.Path({str(steps)!r}).write_text(str(n + 1)); raise MemoryError('CUDA out of memory')"
    sup = Supervisor(grace_s=5, max_restarts=2, backoff_s=0.05)
    sup.start(ChildSpec("learner", _life_script(lives, body), tmp_path / "learner.out", primary=True,
                        restartable=True, progress=_steps(steps)))  # fmt: skip
    with pytest.raises(ChildFailed) as info:
        sup.wait()
    assert lives.read_text() == "xxx" and not info.value.repeated and info.value.restarts == 2
    assert info.value.error == "MemoryError: CUDA out of memory" and "run.max_restarts" in str(info.value)
    sup.stop_all()


def test_a_child_that_fails_at_start_for_a_new_reason_is_restarted(tmp_path: Path) -> None:
    """Each life dies at start, each with another error (Redis not up yet, then a port taken, ...): restarts go
    on to the limit, since the next life may well start."""
    lives = tmp_path / "lives"
    body = "raise ConnectionError(['redis refused', 'port taken', 'engine busy'][n])"
    sup = Supervisor(grace_s=5, max_restarts=2, backoff_s=0.05)
    sup.start(ChildSpec("rollout-0", _life_script(lives, body), tmp_path / "rollout-0.out", restartable=True,
                        progress=lambda: 0))  # fmt: skip
    with pytest.raises(ChildFailed) as info:
        sup.wait()
    assert lives.read_text() == "xxx" and info.value.error == "ConnectionError: engine busy"
    sup.stop_all()


TORCHRUN_FAILS = """
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    raise RuntimeError("learner.use_liger needs a GPU (Liger kernels are Triton); set it to false on CPU")
dist.barrier()
"""


@pytest.mark.slow
def test_a_torchrun_child_that_fails_at_start_ends_with_its_ranks_error(tmp_path: Path) -> None:
    """The learner's shape for real: torchrun with two ranks, rank 0 failing at start. Two lives, and the error
    is rank 0's own line — not torchrun's ``ChildFailedError`` banner, nor rank 1's lost connection."""
    script = tmp_path / "fails.py"
    script.write_text(TORCHRUN_FAILS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    log = tmp_path / "learner.out"
    sup = Supervisor(grace_s=5, max_restarts=3, backoff_s=0.05)
    sup.start(ChildSpec("learner", cmd, log, primary=True, restartable=True, progress=lambda: None))
    with pytest.raises(ChildFailed) as info:
        sup.wait()
    sup.stop_all()
    message = str(info.value)
    assert info.value.repeated and info.value.restarts == 1, message
    assert log.read_text().count("Root Cause") == 2  # two lives of torchrun, each with its banner
    assert info.value.error == "RuntimeError: " + TORCHRUN_FAILS.split('RuntimeError("')[1].split('")')[0]
    assert "ChildFailedError" not in message and "Root Cause" not in message
