"""A run that cannot train stops, saying why and the setting to check, with its books written.

The case that found it: verl's GSM8K parquet (chat-message prompts of a few hundred tokens after the
template) run with ``configs/demo.yaml``, whose ``rollout.max_prompt_len`` is 64. The learner's start check
(``learner.max_prompt_length`` follows ``rollout.max_prompt_len``) fails it at once, naming the row and the
setting; with the limit raised the same file trains. A run every group of which the servers dead-letter
for a reason no start check can see — a reward service nobody listens at — ends after
``learner.stuck_timeout_s`` with the most common reason, instead of issuing and dead-lettering until killed.
No test asserts a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_up import REPO, _summary
from tether.metrics import read_metrics

SUFFIX = ' Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n: int) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them, questions of GSM8K's length."""
    rows = []
    for i in range(n):
        question = (
            f"Natalia sold clips to {40 + i} of her friends in April, and then she sold half as many clips in May. "
            "Each clip costs 3 dollars, and she also sold 12 clips to her neighbours on the weekend. How many "
            "clips did Natalia sell altogether in April and May?"
        )
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + SUFFIX}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "72"},
            "extra_info": {"split": "train", "index": i, "answer": "Natalia sold ... #### 72", "question": question},
        })  # fmt: skip
    return rows


def write_gsm8k(path: Path, n: int = 64) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(gsm8k_rows(n)), path)
    return path


def _up(tmp_path: Path, model: Path, run_id: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tether", "up", "--config", "configs/demo.yaml", "--model.path", str(model),
           "--run.output_dir", str(tmp_path / "runs"), "--run.run_id", run_id, "--run.loggers", "console",
           "--learner.export_hf", "false", *overrides]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)


def _error(out: str) -> str:
    [line] = [x for x in out.splitlines() if x.startswith("tether: error:")]
    return line


@pytest.mark.slow
def test_gsm8k_prompts_over_the_demo_limit_fail_at_start_naming_max_prompt_len(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = write_gsm8k(tmp_path / "train.parquet")
    result = _up(tmp_path, tiny_model_dir, "gsm8k-64", "--learner.data_path", str(data))
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    error = _error(out)
    assert "row 0 of" in error and "over the prompt limit of 64" in error and "rollout.max_prompt_len" in error
    assert "learner.truncation" in error and "filter_overlong_prompts" in error
    assert "run gsm8k-64 failed (learner gave up" in _summary(out)
    assert (tmp_path / "runs" / "gsm8k-64" / "buffer_stats.json").exists()
    assert "child_restarted" not in out, "the learner was restarted: a restart cannot fix a dataset"


@pytest.mark.slow
def test_gsm8k_prompts_train_with_the_limit_raised(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_gsm8k(tmp_path / "train.parquet")
    result = _up(tmp_path, tiny_model_dir, "gsm8k-512", "--learner.data_path", str(data),
                 "--rollout.max_prompt_len", "512", "--learner.total_steps", "2",
                 "--rollout.reward.type", "data_source")  # fmt: skip
    run_dir = tmp_path / "runs" / "gsm8k-512"
    assert result.returncode == 0, result.stdout[-3000:]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    assert [r["step"] for r in rows] == [1, 2]
    books = json.loads((run_dir / "buffer_stats.json").read_text())
    assert books["books"]["run"]["acknowledged"] == 16 and books["books"]["run"]["rollout_dead_letter"] == 0


@pytest.mark.slow
def test_a_run_whose_every_group_is_dead_lettered_stops_naming_the_reason(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Nothing listens at the reward service's address: every group is generated, then dead-lettered. The
    learner gives up after ``learner.stuck_timeout_s`` (10 s here, to keep the test short) of that."""
    from tether.redis_server import free_port

    address = f"127.0.0.1:{free_port()}"
    result = _up(tmp_path, tiny_model_dir, "no-reward", "--rollout.reward.type", "remote",
                 "--rollout.reward.address", address, "--rollout.reward.timeout_s", "1",
                 "--rollout.reward.max_retries", "0", "--learner.stuck_timeout_s", "10")  # fmt: skip
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    error = _error(out)
    assert error.startswith("tether: error: the run cannot train:") and "none trained" in error
    assert "reward failed" in error and address in error and "rollout.reward.address" in error
    assert "learner.stuck_timeout_s" in error
    run_dir = tmp_path / "runs" / "no-reward"
    books = json.loads((run_dir / "buffer_stats.json").read_text())
    assert books["books"]["run"]["acknowledged"] == 0 and books["books"]["run"]["rollout_dead_letter"] >= 8
    summary = _summary(out)
    assert "run no-reward failed (learner gave up" in summary and "before its first learner step" in summary
    assert str(run_dir / "buffer_stats.json") in summary


@pytest.mark.slow
def test_a_learner_started_by_hand_stops_when_its_servers_refuse_every_prompt(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    """A fleet whose rollout server was started with a smaller ``rollout.max_prompt_len`` than the learner's
    config (the learner's start check passes; the server dead-letters every prompt): ``tether learner`` exits
    non-zero naming the reason and the setting, and the books are written."""
    run_id = "by-hand"
    common = ["--config", "configs/demo.yaml", "--model.path", str(tiny_model_dir), "--run.run_id", run_id,
              "--run.output_dir", str(tmp_path / "runs"), "--buffer.redis_url", redis_url]  # fmt: skip
    server_out = (tmp_path / "server.out").open("w")  # a file, not a pipe nobody reads while the learner runs
    server = subprocess.Popen([sys.executable, "-m", "tether", "rollout", *common, "--rollout.max_prompt_len", "3"],
                              cwd=REPO, stdout=server_out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        cmd = [sys.executable, "-m", "tether", "learner", *common, "--learner.stuck_timeout_s", "5"]
        learner = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 timeout=240)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)
        server_out.close()
    out = learner.stdout
    assert learner.returncode != 0, out[-3000:]
    [error] = [x for x in out.splitlines() if x.startswith("learner: error:")]
    assert "the run cannot train" in error and "longer than the limit of 3" in error
    assert "check rollout.max_prompt_len" in error
    run_dir = tmp_path / "runs" / run_id
    books = json.loads((run_dir / "buffer_stats.json").read_text())
    assert books["books"]["run"]["rollout_dead_letter"] >= 8 and books["books"]["run"]["acknowledged"] == 0
    assert "the run cannot train" in (run_dir / "gave_up.txt").read_text()


@pytest.mark.slow
def test_a_learner_that_trained_then_cannot_checkpoints_on_every_rank_and_gives_up(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    """Two gloo ranks train a few steps on a fleet the test plays; then every group is dead-lettered (the reward
    service went away). Rank 0 tells rank 1 why they stop, both write the checkpoint of the last step (a resume
    after the fix loses no step), and the learner exits non-zero with the reason, books and ``gave_up.txt``."""
    import threading

    import redis
    import yaml

    from buffer import RedisKeys, TrajectoryWriter, read_version
    from buffer.dead_letter import dead_letter
    from learner.synthetic import make_groups
    from tether.config import BufferConfig

    run_id = "trained-then-stuck"
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path), "loggers": ["console"]},
        "model": {"path": str(tiny_model_dir)},
        "buffer": {"redis_url": redis_url},
        "rollout": {"max_tokens": 32, "reward": {"type": "remote", "address": "127.0.0.1:9"}},
        "learner": {"total_steps": 100, "train_batch_size": 2, "lr": 1e-4, "checkpoint_every": 0, "export_hf": False,
                    "max_token_len_per_gpu": 64, "data_path": "demo:charclass", "stuck_timeout_s": 4},
        "algorithm": {"max_staleness": 1},
        "weight_sync": {"sync_every": 1, "transport": {"type": "filesystem"}},
    }  # fmt: skip
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stop = threading.Event()

    def fleet() -> None:  # groups at the published version until the learner holds v2, then only dead letters
        client = redis.Redis.from_url(redis_url)
        keys = RedisKeys(run_id)
        writer = TrajectoryWriter(client, keys, BufferConfig(redis_url=redis_url, max_trajectory_groups=8))
        seed = 0
        while not stop.is_set():
            version = read_version(client, keys)
            if version >= 2:
                dead_letter(client, keys, source="rollout-0", data=b"", reason=f"prompt-1{seed}-0: reward failed: "
                            "reward service 127.0.0.1:9: UNAVAILABLE: failed to connect")  # fmt: skip
                stop.wait(0.1)
            else:
                for g in make_groups(1, 4, vocab=256, seed=seed, version=version):
                    try:
                        writer.put(g, timeout_s=0.5)
                    except Exception:
                        continue
            seed += 1
        client.close()

    thread = threading.Thread(target=fleet, daemon=True)
    thread.start()
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "learner",
               "--config", str(cfg_path)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert proc.returncode != 0, proc.stderr[-4000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("learner: error:")]
    assert len(errors) == 1, proc.stderr[-6000:]
    assert "the run cannot train" in errors[0] and "rollout.reward.address" in errors[0]
    run = tmp_path / run_id
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r.get("reward/mean") is not None]
    last = rows[-1]["step"]  # 2, or a little more on groups already buffered at v1 (max_staleness 1)
    assert last >= 2 and [r["step"] for r in rows] == list(range(1, last + 1))
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{last}"]
    assert json.loads((run / "buffer_stats.json").read_text())["books"]["run"]["acknowledged"] == 2 * last
    assert "rollout.reward.address" in (run / "gave_up.txt").read_text()
