"""``tether up`` survives its own children: a SIGKILLed rollout server is started again and rejoins, a
SIGKILLed learner comes back from its last checkpoint; the run finishes with its books balanced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import processes_mentioning
from tests.integration.test_up import REPO, _summary, write_config
from tether.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 14


def _wait_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        rows = [r for r in read_metrics(path) if "reward/mean" in r] if path.exists() else []
        if rows and rows[-1]["step"] >= step:
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.3)
    pytest.fail(f"step {step} not reached")


def test_killed_children_are_restarted_and_the_run_finishes(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = write_config(tmp_path, tiny_model_dir, run_id="restart", steps=STEPS)
    run_dir = tmp_path / "runs" / "restart"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether", "up", "--config", str(cfg), "--learner.checkpoint_every", "2",
         "--run.restart_backoff_s", "0.5"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_step(run_dir, 3, proc)
        (server,) = processes_mentioning(f"{run_dir}/config.yaml --rollout.server_id rollout-0")
        os.kill(server, signal.SIGKILL)
        _wait_step(run_dir, 7, proc)
        (rank,) = processes_mentioning(f"-m learner --config {run_dir}/config.yaml", without="torch.distributed.run")
        os.kill(rank, signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    rollout_log = (run_dir / "logs" / "rollout-0.out").read_text()
    assert rollout_log.count("rollout_server_ready") == 2  # started again, and served
    learner_log = (run_dir / "logs" / "learner-rank0.log").read_text()
    assert '"resume_version"' in learner_log  # the second learner came back from its checkpoint
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert rows[-1]["step"] == STEPS
    books = json.loads((run_dir / "buffer_stats.json").read_text())["books"]["run"]
    assert books["balanced"], books
    assert books["acknowledged"] >= STEPS * 4  # steps after the last checkpoint were trained again


def test_a_learner_that_fails_at_start_the_same_way_twice_ends_the_run_with_its_own_error(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A learner that cannot start (here ``learner.use_liger`` on a CPU: refused as the model is set up) used to
    be restarted three times, 90 s, and the console then showed torchrun's ``ChildFailedError`` banner. Now the
    second life failing the same way ends the run, and the console and the summary show the rank's own error
    line (one rank runs without torchrun, so there is no banner at all)."""
    cfg = write_config(tmp_path, tiny_model_dir, run_id="cannot-start")
    run_dir = tmp_path / "runs" / "cannot-start"
    result = subprocess.run(
        [sys.executable, "-m", "tether", "up", "--config", str(cfg), "--learner.use_liger", "true",
         "--run.max_restarts", "3", "--run.restart_backoff_s", "0.5", "--rollout.num_servers", "1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    cause = "RuntimeError: learner.use_liger needs a GPU (Liger kernels are Triton); set it to false on CPU"
    [error] = [line for line in out.splitlines() if line.startswith("tether: error:")]
    assert "learner failed before it got going, the same way as in its previous life" in error, error
    assert error.endswith(f"{cause} (see {run_dir / 'logs' / 'learner.out'})"), error
    assert "ChildFailedError" not in out and "Root Cause" not in out  # torchrun's banner stays in the log
    assert (run_dir / "logs" / "learner.out").read_text().count(cause) == 2  # two lives, not four
    assert out.count("child_restarted") == 1
    summary = _summary(out)
    assert (
        "failed (learner failed at start twice the same way)" in summary and "before its first learner step" in summary
    )
    assert f"learner's last error: {cause}" in summary
    assert processes_mentioning(str(run_dir)) == []
