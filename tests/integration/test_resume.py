"""Stop a run as a person would, then resume it: the promises of a restart, over three lifetimes.

Lifetime 1 is stopped with SIGTERM mid-run (what ``kill``, systemd and container runtimes send); the
embedded Redis saves its data in the run folder. Lifetime 2 resumes from the run folder alone
(``tether up --resume runs/<id>``) after that data is deleted — Redis comes back empty, as after a crash,
so the learner must put the books back from its checkpoint and reissue the prompts that were
outstanding — and is stopped with SIGTERM again. Lifetime 3 resumes with the run folder's own config
(``--config runs/<id>/config.yaml --resume``) and finishes. Over the whole run:

- every step is trained exactly once, in order, and no group twice (acknowledged = steps × B);
- the admission bound ``issued − given back ≤ (max_staleness + version + 1)·B`` held at every step;
- the books balance with cumulative counters, each lifetime recorded, and at most one bound's worth of
  groups generated ahead at the end;
- no process is left behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import wait_gone
from tests.integration.test_up import REPO, processes_mentioning, write_config
from tether.metrics import read_metrics

B = 4  # train_batch_size in write_config
STALENESS = 1
OPEN_ENDED = 10_000  # lifetimes 1 and 2 are stopped by a signal, never by reaching the end


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(path) if r.get("reward/mean") is not None] if path.exists() else []


def _up(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tether", "up", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_step(proc: subprocess.Popen[str], run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        rows = _steps(run_dir)
        if rows and rows[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"tether up ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"the run never reached step {step}")


def _stop_after(proc: subprocess.Popen[str], run_dir: Path, *, step: int) -> str:
    """SIGTERM ``tether up`` once the learner has logged ``step``; its output."""
    _wait_for_step(proc, run_dir, step)
    children = processes_mentioning(str(run_dir))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out[-3000:]
    assert all(wait_gone(pid, timeout_s=30) for pid in children), processes_mentioning(str(run_dir))
    return out


def _checkpoint_state(run_dir: Path) -> dict:
    folders = sorted(run_dir.glob("checkpoints/step_*/trainer_state.json"), key=lambda p: int(p.parent.name[5:]))
    return json.loads(folders[-1].read_text())["state"]


@pytest.mark.slow
def test_sigterm_resume_twice_keeps_bound_books_and_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = write_config(tmp_path, tiny_model_dir, run_id="resume", steps=OPEN_ENDED)
    run_dir = tmp_path / "runs" / "resume"

    # Lifetime 1: SIGTERM mid-run. The learner finishes its step and checkpoints; Redis saves its data.
    proc = _up(["--config", str(cfg)])
    _wait_for_step(proc, run_dir, 2)
    # `tether status` finds the running run by its id alone, though its Redis is embedded.
    by_id = ["--run.run_id", "resume", "--run.output_dir", str(tmp_path / "runs")]
    status = subprocess.run(
        [sys.executable, "-m", "tether", "status", *by_id], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    assert "rollout servers: 2 live" in status.stdout and "books: produced" in status.stdout
    out = _stop_after(proc, run_dir, step=4)
    assert "books: produced" in out
    saved = _checkpoint_state(run_dir)
    assert saved["step"] == _steps(run_dir)[-1]["step"]  # the interrupted run kept its last step
    assert (run_dir / "redis" / "dump.rdb").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["buffer"]["redis_url"] == ""

    # Lifetime 2: Redis comes back without the run (its saved data deleted, as after a crash).
    (run_dir / "redis" / "dump.rdb").unlink()
    _stop_after(_up(["--resume", str(run_dir)]), run_dir, step=saved["step"] + 3)
    second = _checkpoint_state(run_dir)

    # Lifetime 3: the run folder's own config, to the end.
    (run_dir / "redis" / "dump.rdb").unlink()  # once more through the restore path
    total = second["step"] + 4
    proc = _up(["--config", str(run_dir / "config.yaml"), "--resume", "--learner.total_steps", str(total)])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]

    rows = _steps(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))  # each step once, none lost or repeated
    for r in rows:  # the admission bound held at every step of every lifetime
        assert r["buffer/prompts_issued"] <= r["buffer/admission_bound"], r
    positions = [r["learner/data_position"] for r in rows]
    assert positions == sorted(positions)  # the dataset position never went back

    stats = json.loads((run_dir / "buffer_stats.json").read_text())
    books = stats["books"]["run"]
    assert books["balanced"], books
    assert books["acknowledged"] == total * B  # cumulative, and no group trained twice
    assert books["in_stream"] <= (STALENESS + 1) * B  # at most one bound's worth generated ahead
    # Each restore reissued exactly the prompts outstanding at its checkpoint, and counted the lost groups.
    ledgers = [saved["ledger"], second["ledger"]]
    assert books["prompts_reissued"] == sum(len(ledger["outstanding"]) for ledger in ledgers) > 0
    assert books["lost_in_restart"] == sum(ledger["in_stream"] for ledger in ledgers)
    lives = stats["books"]["lifetimes"]
    assert [life["start_step"] for life in lives] == [0, saved["step"], second["step"]]
    assert sum(life["acknowledged"] for life in lives) == total * B
    final_version = rows[-1]["learner/version"]
    assert (
        books["prompts_issued"] <= (STALENESS + final_version + 1) * B + books["dropped_stale"] + books["dead_letter"]
    )
    assert processes_mentioning(str(run_dir)) == []
