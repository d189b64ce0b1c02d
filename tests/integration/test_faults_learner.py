"""The learner killed with SIGKILL mid-step, then started again with ``--resume``: nothing is lost.

Redis outlives the learner (the test owns it). The learner is killed while it holds groups it has read
and not yet acknowledged; the restarted learner loads its last checkpoint, takes those groups back
(``TrajectoryReader.recover``: its own pending entries), continues to ``total_steps``, and at the end
the books balance: every group produced was trained on (acknowledged), dropped as stale, dead-lettered,
or is still in the stream.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from buffer import LEARNER_GROUP
from learner.checkpoint import latest_checkpoint
from tests.integration.fault_harness import Run, write_config
from tether.redis_server import EmbeddedRedis

STEPS = 10
CHECKPOINT_EVERY = 2


def _learner_pending(run: Run) -> int:
    client = run.client()
    try:
        return int(client.xpending(run.keys.trajectories, LEARNER_GROUP)["pending"])
    finally:
        client.close()


@pytest.mark.slow
def test_killed_learner_resumes_from_checkpoint_and_the_books_balance(tmp_path: Path, tiny_model_dir: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis") as url:
        run_id = "fault-learner"
        cfg = write_config(tmp_path, tiny_model_dir, run_id=run_id, redis_url=url, steps=STEPS,
                           checkpoint_every=CHECKPOINT_EVERY)  # fmt: skip
        run = Run(tmp_path, cfg, run_id, url)
        try:
            learner = run.learner()
            servers = (run.server("rollout-0"), run.server("rollout-1"))
            run.wait_for("a checkpoint and a step past it", lambda: len(run.steps()) > CHECKPOINT_EVERY,
                         must_live=(learner, *servers))  # fmt: skip

            # Kill it while it trains on groups it has read but not acknowledged (they are pending on it). A
            # step is short, so freeze it first (SIGSTOP) and check the groups are still pending, else let it
            # go on and look again: the SIGKILL then lands while they certainly are.
            def frozen_holding_groups() -> bool:
                if _learner_pending(run) == 0:
                    return False
                learner.signal_tree(signal.SIGSTOP)
                if _learner_pending(run) > 0:
                    return True
                learner.signal_tree(signal.SIGCONT)
                return False

            run.wait_for("the learner to hold unacknowledged groups", frozen_holding_groups,
                         must_live=(learner,), poll_s=0.01)  # fmt: skip
            learner.kill()
            held = _learner_pending(run)  # the learner is dead: this no longer changes
            published_at_kill = run.version()
            assert held > 0
            steps_before = run.steps()
            assert steps_before[-1] < STEPS  # it really was killed mid-run
            ckpt = latest_checkpoint(run.dir / "checkpoints")
            assert ckpt is not None
            resumed_from = int(ckpt.name.split("_")[1])

            resumed = run.learner(resume=True)
            resumed.proc.wait(timeout=240)
            assert resumed.proc.returncode == 0, run.logs()
            out = resumed.log.read_text(errors="replace")
            # it took back exactly what the killed one had read and not acknowledged
            recovered = re.search(r"recovered_groups=(\d+)", out)
            assert recovered is not None and int(recovered.group(1)) == held, out[-3000:]
            assert f"step_{resumed_from}" in out  # checkpoint_loaded names the folder it resumed from

            # the step count continues from the checkpoint to total_steps
            steps = run.steps()
            after = steps[len(steps_before) :]
            assert after == list(range(resumed_from + 1, STEPS + 1))
            # Versions never go back: one published after the checkpoint is continued after (the resumed
            # learner publishes its own weights first), so the end version counts the steps from there.
            planned = re.search(r"resume_version\b.*?\bversion=(\d+)", out)
            assert planned is not None, out[-3000:]
            start = int(planned.group(1))
            # (a snapshot written after the checkpoint but not yet announced also moves it past the checkpoint)
            assert start > published_at_kill if published_at_kill > resumed_from else start >= resumed_from
            assert run.version() == start + STEPS - resumed_from
            assert all(s.alive() for s in servers), run.logs()
            for s in servers:
                s.stop()

            stats = run.stats()
            assert stats["buffer/pending"] == 0  # nothing left read-but-unacknowledged
            assert stats["buffer/produced"] == (
                stats["buffer/acknowledged"] + stats["buffer/dropped_stale"] + stats["buffer/dead_letter"]
                + stats["buffer/depth"]
            ), stats  # fmt: skip
            # Every logged step acknowledged its 2 groups; the killed learner may have acknowledged one more
            # batch after its optimizer step but before it logged that step.
            assert 2 * len(steps) <= stats["buffer/acknowledged"] <= 2 * (len(steps) + 1)
        finally:
            run.close()
