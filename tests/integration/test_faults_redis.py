"""Redis killed mid-run and started again from its append-only file: the run reconnects and finishes.

The test owns a Redis with ``appendonly yes`` (``appendfsync everysec``, as ``buffer.appendonly`` starts
the embedded one). Mid-run it is killed with SIGKILL — no shutdown save, so only what the AOF had
fsynced survives — kept down for a few seconds, then started again on the same port and folder. The
learner and the rollout servers must ride through the outage (redis-py retries with backoff, and the
long-running loops retry what still fails), the run must reach ``total_steps``, and what the buffer had
counted more than the fsync window (about 1 s) before the crash must still be there afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.fault_harness import Run, write_config
from tether.redis_server import EmbeddedRedis

STEPS = 200  # ~25 steps/s on 2 cores: the outage must come well before the end (40 once finished first)
OUTAGE_S = 4.0
FSYNC_WINDOW_S = 1.0  # appendfsync everysec


@pytest.mark.slow
def test_redis_restarted_from_aof_the_run_reconnects_and_finishes(tmp_path: Path, tiny_model_dir: Path) -> None:
    redis_dir = tmp_path / "redis"
    redis = EmbeddedRedis(redis_dir, appendonly=True)
    url = redis.start()
    run_id = "fault-redis"
    cfg = write_config(tmp_path, tiny_model_dir, run_id=run_id, redis_url=url, steps=STEPS,
                       learner={"read_timeout_s": 30})  # fmt: skip
    run = Run(tmp_path, cfg, run_id, url)
    try:
        learner = run.learner()
        servers = (run.server("rollout-0"), run.server("rollout-1"))
        # Both servers registered: the outage must hit servers that run (one still loading its engine would
        # meet a refused first connection, which is a start failure, not an outage).
        run.wait_for("two learner steps and both servers registered",
                     lambda: len(run.steps()) >= 2 and {"rollout-0", "rollout-1"} <= set(run.registry_versions()),
                     must_live=(learner, *servers))  # fmt: skip

        before = run.stats()
        # Let one fsync pass, so everything counted in `before` is on disk: the crash may lose only
        # writes made after this point (the documented window of appendfsync everysec).
        time.sleep(FSYNC_WINDOW_S + 0.5)
        assert learner.alive(), run.logs()  # the outage must hit a running learner, not a finished one
        redis.process.kill()  # SIGKILL: no shutdown save
        redis.process.wait(timeout=10)
        redis.stop()
        time.sleep(OUTAGE_S)  # the outage itself: every client sees connection refused meanwhile
        assert learner.alive() and all(s.alive() for s in servers), run.logs()

        redis = EmbeddedRedis(redis_dir, port=redis.port, appendonly=True)
        redis.start()
        after_restart = run.stats()
        for name in ("produced", "acknowledged", "dropped_stale", "dead_letter", "prompts_issued", "prompts_done"):
            assert after_restart[f"buffer/{name}"] >= before[f"buffer/{name}"], (name, before, after_restart)

        learner.proc.wait(timeout=150)
        assert learner.proc.returncode == 0, run.logs()
        assert run.steps()[-1] == STEPS
        assert all(s.alive() for s in servers), run.logs()
        for s in servers:
            assert s.stop() == 0, run.logs()

        stats = run.stats()
        assert stats["buffer/acknowledged"] >= before["buffer/acknowledged"]
        assert stats["buffer/pending"] == 0
        assert stats["buffer/produced"] == (
            stats["buffer/acknowledged"] + stats["buffer/dropped_stale"] + stats["buffer/dead_letter"]
            + stats["buffer/depth"]
        ), stats  # fmt: skip
    finally:
        run.close()
        redis.stop()
