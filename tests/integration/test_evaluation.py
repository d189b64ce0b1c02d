"""Evaluation rounds through a real rollout server process and a real Redis.

The learner's :class:`learner.evaluation.Evaluator` issues held-out prompts; the server samples, scores
and reports them on the validation streams. What must hold: every prompt comes back scored, the metrics
row is logged at the evaluated step, and nothing of it reaches the trajectories stream or the training
books. Without a server a round is closed by its timeout with every prompt counted missing.
"""

from __future__ import annotations

import io
import time
import uuid
from pathlib import Path

import pytest
import redis

from buffer import RedisKeys, buffer_stats
from learner.evaluation import Evaluator
from rollout_server.launch import ServerProcess, spawn_server
from tether.commands.status import show_status
from tether.config import load_config
from tether.metrics import JsonlMetrics, MetricsLogger, read_metrics
from tether.redis_server import free_port

pytestmark = pytest.mark.slow
N_PROMPTS, K = 6, 3


def _cfg(redis_url: str, run_id: str, **learner: object):
    overrides = ["--run.run_id", run_id, "--buffer.redis_url", redis_url, "--rollout.max_tokens", "6",
                 "--learner.val_data_path", "demo:charclass", "--learner.val_max_prompts", str(N_PROMPTS),
                 "--learner.val_n", str(K), "--learner.val_temperature", "1.0"]  # fmt: skip
    for key, value in learner.items():
        overrides += [f"--learner.{key}", str(value)]
    return load_config(None, overrides)


@pytest.fixture(scope="module")
def run_id() -> str:
    return f"ev-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, redis_server: str, run_id: str, tmp_path_factory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("eval")
    args = ["--model.path", str(tiny_model_dir), "--run.run_id", run_id, "--run.output_dir", str(tmp / "runs"),
            "--buffer.redis_url", redis_server, "--rollout.server_id", "rollout-eval",
            "--rollout.prompt_workers", "2", "--rollout.heartbeat_s", "0.5"]  # fmt: skip
    proc = spawn_server(args, port=free_port(), log_path=tmp / "server.log")
    yield proc
    proc.terminate()


def test_a_round_is_scored_by_the_server_and_stays_out_of_the_books(
    server: ServerProcess, redis_server: str, run_id: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_server)
    keys = RedisKeys(run_id)
    before = buffer_stats(client, keys)
    metrics = JsonlMetrics(tmp_path / "metrics.jsonl")
    evaluator = Evaluator(_cfg(redis_server, run_id, test_freq=5, total_steps=10), client, keys, metrics)
    evaluator.maybe_start(3, 0)  # not a multiple of test_freq: nothing issued
    assert evaluator.rounds == {}
    evaluator.maybe_start(5, 0)
    assert len(evaluator.rounds) == 1
    deadline = time.monotonic() + 180
    done: list[dict[str, float]] = []
    while not done and time.monotonic() < deadline:
        done = evaluator.poll()
        time.sleep(0.2)
    metrics.close()
    assert done, "the evaluation round never completed"
    m = done[0]
    assert m["val/prompts"] == N_PROMPTS and m["val/missing"] == 0
    assert m["val/k"] == K and m["val/version"] == 0
    assert 0.0 <= m["val/mean@k"] <= m["val/best@k"] <= 1.0
    assert m["val/pass@1"] <= m["val/pass@k"]
    assert m["val/tokens_mean"] > 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [5]  # logged at the step whose weights it evaluated
    assert rows[0]["val/mean@k"] == pytest.approx(m["val/mean@k"])
    # Nothing reached training: no trajectories, no counter moved, the validation streams are drained.
    assert buffer_stats(client, keys) == before | {"buffer/oldest_age_s": 0.0}
    assert client.xlen(keys.trajectories) == 0
    assert client.xlen(keys.val_prompts) == 0 and client.xlen(keys.val_results) == 0
    out = io.StringIO()
    assert show_status(_cfg(redis_server, run_id), out=out, interval_s=0.01) == 0
    assert f"validation (step 5): mean@{K} {m['val/mean@k']:.3f}   pass@{K} {m['val/pass@k']:.3f}" in out.getvalue()
    client.close()


def test_a_round_without_servers_times_out_with_every_prompt_missing(redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(f"ev-none-{uuid.uuid4().hex[:6]}")
    metrics = JsonlMetrics(tmp_path / "metrics.jsonl")
    evaluator = Evaluator(_cfg(redis_url, keys.run_id, val_before_train=True, val_timeout_s=0.5), client, keys,
                          metrics)  # fmt: skip
    evaluator.maybe_start(0, 0)
    evaluator.finish()  # returns: the timeout closes the round
    metrics.close()
    assert evaluator.rounds == {}
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["step"] == 0 and row["val/missing"] == N_PROMPTS and row["val/prompts"] == 0
    assert "val/mean@k" not in row
    client.close()


def test_evaluation_goes_ahead_of_queued_training_prompts(
    server: ServerProcess, redis_server: str, run_id: str, tmp_path: Path
) -> None:
    from buffer import PromptQueue
    from tether.tasks import demo_rows
    from tether.v1.trajectory_pb2 import Prompt

    client = redis.Redis.from_url(redis_server)
    keys = RedisKeys(run_id)
    queued = 30
    rows = [Prompt(prompt_id=f"t{i}", dataset_index=i, text=r["prompt"], reward_context={"answer": r["answer"]})
            for i, r in zip(range(queued), demo_rows(seed=4), strict=False)]  # fmt: skip
    assert PromptQueue(client, keys).feed(iter(rows), version=0, prompts_per_version=100, max_staleness=0) == queued
    evaluator = Evaluator(_cfg(redis_server, run_id, val_before_train=True), client, keys, MetricsLogger())
    evaluator.maybe_start(0, 0)
    done: list[dict[str, float]] = []
    deadline = time.monotonic() + 180
    while not done and time.monotonic() < deadline:
        done = evaluator.poll()
        time.sleep(0.1)
    assert done and done[0]["val/missing"] == 0
    # Two prompt workers: at most the training prompts they already held (plus one each they may have
    # taken while the round was being written) were done first; the rest still wait behind evaluation.
    assert client.xlen(keys.prompts) >= queued - 4
    client.delete(keys.prompts)  # leave the server idle for the module's teardown
    client.close()
