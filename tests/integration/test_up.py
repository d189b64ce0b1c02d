"""``tether up`` end to end: embedded Redis, the learner under torchrun and two rollout servers, for real.

A short run on a tiny model must: complete its learner steps, train on data from advancing policy
versions, acknowledge every group it trained on, write metrics and the curves PNG, and leave no process
behind — also when it is interrupted with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import wait_gone
from tether.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def write_config(
    tmp_path: Path, model: Path, *, run_id: str, steps: int = STEPS, transport: str = "filesystem"
) -> Path:
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path / "runs"), "tensorboard": False},
        "model": {"path": str(model)},
        "rollout": {
            "engine": {"type": "transformers", "max_num_seqs": 32},
            "reward": {"type": "demo"},
            "n": 4,
            "max_tokens": 8,
            "num_servers": 2,
            "prompt_workers": 2,
            "drain_timeout_s": 5,
        },
        "learner": {
            "total_steps": steps,
            "train_batch_size": 4,
            "lr": 3e-3,
            "data_path": "demo:charclass",
            "checkpoint_every": 0,
            "read_timeout_s": 240,
        },
        "algorithm": {"max_staleness": 1},
        "weight_sync": {"transport": {"type": transport, **({"master_port": 0} if transport == "gloo" else {})}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def processes_mentioning(needle: str) -> list[int]:
    """PIDs of live processes whose command line mentions ``needle`` (the run folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split()[2]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if needle in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["filesystem", "gloo"])
def test_short_run_trains_acknowledges_and_cleans_up(tmp_path: Path, tiny_model_dir: Path, transport: str) -> None:
    run_id = f"up-{transport}"
    cfg = write_config(tmp_path, tiny_model_dir, run_id=run_id, transport=transport)
    result = subprocess.run(
        [sys.executable, "-m", "tether", "up", "--config", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    run_dir = tmp_path / "runs" / run_id
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.out")))
    assert result.returncode == 0, result.stderr[-3000:] + logs

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # versions advance: the last step trained on tokens of a later policy than the first step did
    assert rows[0]["data/version_max"] == 0
    assert rows[-1]["data/version_max"] >= 1
    assert all(r["staleness/max"] <= 1 for r in rows)  # max_staleness: 1
    if transport == "gloo":  # both servers were reached by the last update over the collective
        assert rows[-1]["weight_sync/reached"] == 2

    # every group trained on was acknowledged, nothing was read and left unacknowledged
    stats = json.loads((run_dir / "buffer_stats.json").read_text())
    trained_groups = sum(r["data/groups"] for r in rows)
    assert stats["buffer/acknowledged"] == trained_groups == STEPS * 4
    assert stats["buffer/pending"] == 0
    assert stats["buffer/dead_letter"] == 0
    assert stats["buffer/produced"] == (
        stats["buffer/acknowledged"] + stats["buffer/dropped_stale"] + stats["buffer/depth"]
    )

    assert (run_dir / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (run_dir / "final" / "config.json").exists()
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow
def test_ctrl_c_stops_everything(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_id = "up-interrupt"
    cfg = write_config(tmp_path, tiny_model_dir, run_id=run_id, steps=10_000)
    run_dir = tmp_path / "runs" / run_id
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether", "up", "--config", str(cfg)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait until training is really under way
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and read_metrics(metrics):
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    else:
        pytest.fail("the run never logged a step")
    children = processes_mentioning(str(run_dir))
    assert len(children) >= 4  # learner (torchrun + rank), two rollout servers, redis
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out
    assert all(wait_gone(pid, timeout_s=30) for pid in children), processes_mentioning(str(run_dir))
