"""A learner started without ``--resume`` on a run that already trained stops at once and says how to
continue it, instead of waiting forever for servers that hold the old run's later versions."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from buffer import RedisKeys, publish_version
from learner.checkpoint import TrainState
from learner.lifecycle import RunHasHistory, refuse_fresh_start
from learner.rank_zero import RankZero
from tether.config import load_config
from tether.runs import run_paths


def test_refusal_names_what_the_run_already_has() -> None:
    refuse_fresh_start("new", published=0, checkpoint_step=None, folder="/runs/new")  # a new run: no error
    with pytest.raises(RunHasHistory, match=r"policy version 3 .*checkpoints up to step 12 in /runs/r.*--resume"):
        refuse_fresh_start("r", published=3, checkpoint_step=12, folder="/runs/r")
    with pytest.raises(RunHasHistory, match=r"checkpoints up to step 0 in"):
        refuse_fresh_start("r", published=0, checkpoint_step=0, folder="/runs/r")


def test_learner_without_resume_refuses_a_run_whose_redis_has_versions(redis_url: str, tmp_path: Path) -> None:
    run_id = f"fresh-{uuid.uuid4().hex[:6]}"
    cfg = load_config(None, ["--run.run_id", run_id, "--run.output_dir", str(tmp_path),
                             "--buffer.redis_url", redis_url])  # fmt: skip
    paths = run_paths(cfg).make()
    zero = RankZero(cfg, paths, TrainState(), resume=False)  # a new run starts
    zero.client.close()
    publish_version(zero.client, RedisKeys(run_id), 30)  # ... and publishes (the client reconnects)
    with pytest.raises(RunHasHistory, match=rf"run {run_id} already trained \(policy version 30"):
        RankZero(cfg, paths, TrainState(), resume=False)
    resumed = RankZero(cfg, paths, TrainState(), resume=True)  # continuing it is what the message says to do
    assert resumed.published_version() >= 30
