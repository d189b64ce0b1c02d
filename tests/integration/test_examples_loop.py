"""The examples as users run them: separate processes whose trajectories the learner trains on.

The guessing-game environment drives multi-turn episodes over gRPC against a rollout server started by
``tether up``; the example reward service scores the prompts-stream groups of another run. In both, the
learner must finish its steps on exactly that data and acknowledge it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tether.metrics import read_metrics
from tether.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, model: Path, *, run_id: str, rollout: dict, learner: dict) -> Path:
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path / "runs"), "loggers": ["console"]},
        "model": {"path": str(model)},
        "rollout": {"engine": {"type": "transformers"}, "n": 4, "max_tokens": 8, "num_servers": 1, **rollout},
        "learner": {"total_steps": 2, "train_batch_size": 2, "checkpoint_every": 0, "export_hf": False,
                    "read_timeout_s": 300, "lr": 1e-3, **learner},
    }  # fmt: skip
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def finished_run(proc: subprocess.Popen[str], run_dir: Path) -> tuple[list[dict], dict]:
    out, _ = proc.communicate(timeout=420)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*.out")))
    assert proc.returncode == 0, out[-2000:] + logs
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("data/groups") is not None]
    return rows, json.loads((run_dir / "buffer_stats.json").read_text())


def start_up(cfg: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tether", "up", "--config", str(cfg)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def train_on_a_client(tmp_path: Path, model: Path, *, run_id: str, rollout: dict, client: list[str],
                      says: str) -> None:  # fmt: skip
    """``tether up`` with no prompt workers (every group the learner gets comes from the client's episodes), the
    example ``client`` run to its end (its output says ``says``); the learner trains 2 steps on exactly the 4
    groups the client wrote."""
    cfg = config(tmp_path, model, run_id=run_id, rollout={**rollout, "prompt_workers": 0}, learner={})
    up = start_up(cfg)
    try:
        out = subprocess.run([sys.executable, *client, "--tasks", "4", "--group-size", "3", "--max-turns", "3"],
                             cwd=REPO, capture_output=True, text=True, timeout=420)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert says in out.stdout
        rows, stats = finished_run(up, tmp_path / "runs" / run_id)
    finally:
        up.kill()
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["data/groups"] for r in rows) == 4 == stats["buffer/acknowledged"]
    assert stats["buffer/produced"] == 4 and stats["buffer/dead_letter"] == 0


@pytest.mark.slow
def test_environment_episodes_are_trained_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    train_on_a_client(tmp_path, tiny_model_dir, run_id="env", rollout={"port": port},
                      client=["examples/guessing_game.py", "--server", f"127.0.0.1:{port}"],
                      says="episodes 12, groups written 4")  # fmt: skip


@pytest.mark.slow
def test_an_openai_agent_s_episodes_are_trained_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    """examples/openai_agent.py, written against the OpenAI API, plays through the rollout server's door; the
    learner trains on exactly its groups."""
    port = free_port()
    train_on_a_client(tmp_path, tiny_model_dir, run_id="agent", rollout={"openai": {"port": port}},
                      client=["examples/openai_agent.py", "--base-url", f"http://127.0.0.1:{port}/v1"],
                      says="episodes 12,")  # fmt: skip


@pytest.mark.slow
def test_reward_service_scores_what_the_learner_trains_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(5) for b in range(5)))  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "examples/reward_service.py", "--port", str(port), "--host", "127.0.0.1"]
    service = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "listening" in service.stdout.readline()
        cfg = config(
            tmp_path, tiny_model_dir, run_id="rewarded",
            rollout={"reward": {"type": "remote", "address": f"127.0.0.1:{port}"}, "prompt_workers": 2},
            learner={"data_path": str(data)},
        )  # fmt: skip
        rows, stats = finished_run(start_up(cfg), tmp_path / "runs" / "rewarded")
    finally:
        service.send_signal(signal.SIGTERM)
        out, _ = service.communicate(timeout=30)
    assert [r["step"] for r in rows] == [1, 2]
    assert stats["buffer/acknowledged"] == 4 and stats["buffer/dead_letter"] == 0
    scored = int(out.rsplit("after scoring ", 1)[1].split()[0])
    assert scored >= 4 * 4  # every sample of the 4 trained groups went through the service


@pytest.mark.slow
def test_greedy_check_sees_each_version_served_as_the_learner_has_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """examples/greedy_check.py beside a run: the server's greedy completion after each weight update equals the
    learner's snapshot's. The check stops after 3 versions, then the run is stopped (it would train up to 2000
    steps: however slow the machine, the run outlives the check's start)."""
    port = free_port()
    cfg = config(tmp_path, tiny_model_dir, run_id="greedy", rollout={"port": port, "prompt_workers": 2},
                 learner={"total_steps": 2000, "lr": 3e-3, "data_path": "demo:charclass"})  # fmt: skip
    raw = yaml.safe_load(cfg.read_text())
    raw["weight_sync"] = {"keep_snapshots": 50}  # a version checked is still on disk while it is loaded
    cfg.write_text(yaml.safe_dump(raw))
    up = start_up(cfg)
    try:
        check = subprocess.run([sys.executable, "examples/greedy_check.py", "--server", f"127.0.0.1:{port}",
                                "--run", str(tmp_path / "runs" / "greedy"), "--every-s", "0.3", "--versions", "3",
                                "--start-timeout-s", "240"], cwd=REPO, capture_output=True, text=True,
                               timeout=280)  # fmt: skip
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.communicate()
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    summary = check.stdout.strip().splitlines()[-1]
    checked = [int(v) for v in summary.split("(", 1)[1].split(")", 1)[0].strip("[]").split(",")]
    assert summary.startswith("greedy check: 3/3 versions equal"), summary
    assert max(checked) >= 1, summary  # trained versions, not only the base
