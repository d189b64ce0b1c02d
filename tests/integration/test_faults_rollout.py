"""A rollout server killed with SIGKILL mid-run: the run goes on and the dead server's prompts are not lost.

Two servers share the prompts stream. One is killed while it holds prompts (read, not yet answered);
the learner keeps completing steps on the other's groups, the other reclaims the dead one's prompts
once they have been idle ``buffer.claim_idle_ms`` (XAUTOCLAIM), and a server started again under a new
id joins at the learner's current policy version (snapshot catch-up at start, then updates).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from buffer import PROMPT_GROUP
from tests.integration.fault_harness import Run, write_config
from tether.redis_server import EmbeddedRedis

STEPS = 16


def _pending_of(run: Run, consumer: str) -> list[str]:
    client = run.client()
    try:
        rows = client.xpending_range(run.keys.prompts, PROMPT_GROUP, "-", "+", 100, consumername=consumer)
        return [r["message_id"].decode() for r in rows]
    finally:
        client.close()


@pytest.mark.slow
def test_killed_rollout_server_prompts_are_reclaimed_and_a_new_one_rejoins(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with EmbeddedRedis(tmp_path / "redis") as url:
        run_id = "fault-rollout"
        cfg = write_config(tmp_path, tiny_model_dir, run_id=run_id, redis_url=url, steps=STEPS)
        run = Run(tmp_path, cfg, run_id, url)
        try:
            learner = run.learner()
            survivor = run.server("rollout-0")
            # rollout-1 writes longer completions, so it holds each prompt long enough to be caught holding one
            victim = run.server("rollout-1", "--rollout.max_tokens", "48")
            run.wait_for("two learner steps", lambda: len(run.steps()) >= 2, must_live=(learner, survivor, victim))

            # Kill rollout-1 the moment it holds prompts it has not answered (SIGKILL: no drain, no ack).
            held: list[str] = []

            def victim_holds_prompts() -> bool:
                held[:] = _pending_of(run, "rollout-1")
                return bool(held)

            run.wait_for("rollout-1 to hold a prompt", victim_holds_prompts, must_live=(learner, victim),
                         poll_s=0.01)  # fmt: skip
            victim.kill()
            step_at_kill = len(run.steps())

            # rollout-0 claims them once idle for claim_idle_ms, answers and acknowledges them (acked
            # prompts are deleted from the stream, so each held id disappears from it).
            def reclaimed() -> bool:
                client = run.client()
                try:
                    return all(not client.xrange(run.keys.prompts, eid, eid) for eid in held)
                finally:
                    client.close()

            run.wait_for("the dead server's prompts to be answered", reclaimed, must_live=(survivor,))
            assert _pending_of(run, "rollout-1") == []
            # The learner goes on to its last step on what rollout-0 produces (it was mid-run at the kill).
            assert step_at_kill < STEPS
            learner.proc.wait(timeout=240)
            assert learner.proc.returncode == 0, run.logs()
            assert run.steps()[-1] == STEPS
            final = run.version()
            assert final == STEPS  # sync_every 1: one publication per step

            # A server started again (new id, as a replacement would be) comes up on the current weights:
            # the learner's last published version, loaded from its snapshot before serving.
            rejoined = run.server("rollout-9")
            run.wait_for("rollout-9 to register", lambda: "rollout-9" in run.registry_versions(), must_live=(rejoined,))
            assert run.registry_versions()["rollout-9"] == final
            assert survivor.alive() and rejoined.alive()
            assert run.steps()[-1] == STEPS

            survivor.stop()
            rejoined.stop()
            stats = run.stats()
            assert stats["buffer/pending"] == 0
            assert stats["buffer/acknowledged"] == 2 * STEPS
            assert stats["buffer/produced"] == (
                stats["buffer/acknowledged"] + stats["buffer/dropped_stale"] + stats["buffer/dead_letter"]
                + stats["buffer/depth"]
            )  # fmt: skip
        finally:
            run.close()
