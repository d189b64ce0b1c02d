"""A learner and a rollout server started by hand on one machine (docs/FLEETS.md), not by ``tether up``.

They used to run at a fraction of ``tether up``'s speed (each process took every core), the rollout server
kept running after the learner had finished, and neither the plot nor the books were written. Now each
process takes its share of the cores, the learner publishes the run's end and a server started with
``--exit-when-run-ends`` exits 0 by itself, and the run folder holds the books and the plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_up import REPO, write_config

pytestmark = pytest.mark.slow


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _wait_for_exec(pid: int, needle: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} never became {needle}")


def _ready_event(log: Path) -> dict:
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "rollout_server_ready":
            return event
    raise AssertionError(f"no rollout_server_ready in {log}")


def test_separate_processes_share_the_cores_and_the_server_exits_when_the_run_ends(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    run_id = "fleet-by-hand"
    cfg = write_config(tmp_path, tiny_model_dir, run_id=run_id, steps=4)  # 1 learner rank + 2 servers per config
    run_dir = tmp_path / "runs" / run_id
    expected = str(max(1, (os.cpu_count() or 1) // 3))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    common = ["--config", str(cfg), "--run.run_id", run_id, "--buffer.redis_url", redis_url]
    server = subprocess.Popen(
        [sys.executable, "-m", "tether", "rollout", *common, "--rollout.server_id", "by-hand", "--exit-when-run-ends"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    learner = subprocess.Popen([sys.executable, "-m", "tether", "learner", *common], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        # `tether learner` becomes the learner (exec; one rank: no torchrun): the split is in its environment
        _wait_for_exec(learner.pid, "-m\x00learner\x00")
        assert _environ(learner.pid).get("OMP_NUM_THREADS") == expected
        learner_out, _ = learner.communicate(timeout=420)
        assert learner.returncode == 0, learner_out[-3000:]
        # no signal: the server sees the run's end in Redis, drains and exits 0
        server_out, _ = server.communicate(timeout=120)
        assert server.returncode == 0, server_out[-3000:]
    finally:
        for proc in (server, learner):
            if proc.poll() is None:
                proc.kill()
    assert "run_ended_exiting" in server_out
    assert _ready_event(run_dir / "logs" / "by-hand.log")["threads"] == int(expected)
    stats = json.loads((run_dir / "buffer_stats.json").read_text())
    assert stats["buffer/acknowledged"] == 4 * 4
    assert (run_dir / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
