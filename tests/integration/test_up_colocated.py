"""``tether up`` on one shared GPU starts the learner only after the co-located rollout server has loaded.

vLLM sizes its KV cache by profiling the GPU's memory while it loads, assuming nothing else allocates, and
refuses to start when less than its share is free; a learner loading beside it upsets both. So on a shared
GPU (``configs/one-gpu.yaml``) the servers start first and the learner waits for their registration.

The real ``up()`` runs here with the box made to look like one GPU and the two processes replaced by small
scripts (no GPU, no vLLM): the fake server registers — as a real one does once its engine has loaded — only
after the learner has started or 5 s have passed, and the fake learner records which servers were registered
when it started. Launched together (the order before this fix), the learner starts first and sees none.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tether.commands import launcher
from tether.config import TetherConfig

pytestmark = pytest.mark.slow

_SERVER = """
import sys, time
from pathlib import Path
import redis
from buffer import RedisKeys
from buffer.registry import ServerInfo, ServerRegistry
url, run_id, name, learner_started, code = sys.argv[1:6]
if int(code):
    sys.exit(int(code))  # an engine that fails while it loads
deadline = time.monotonic() + 5  # loading the engine; a learner that starts meanwhile ends it early
while time.monotonic() < deadline and not Path(learner_started).exists():
    time.sleep(0.05)
registry = ServerRegistry(redis.Redis.from_url(url), RedisKeys(run_id))
while True:
    registry.heartbeat(ServerInfo(name, engine="fake"), ttl_s=5)
    time.sleep(1)
"""

_LEARNER = """
import json, sys
from pathlib import Path
import redis
from buffer import RedisKeys
from buffer.registry import ServerRegistry
url, run_id, seen, learner_started = sys.argv[1:5]
live = [info.server_id for info in ServerRegistry(redis.Redis.from_url(url), RedisKeys(run_id)).live()]
Path(seen).write_text(json.dumps(live))
Path(learner_started).touch()
"""


def _one_gpu_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, server_exit: int = 0) -> TetherConfig:
    cfg = TetherConfig.model_validate(
        {
            "run": {"run_id": "colocated", "output_dir": str(tmp_path / "runs"), "max_restarts": 0},
            "model": {"path": str(tmp_path / "model")},
            "rollout": {"engine": {"type": "vllm", "gpu_memory_utilization": 0.4}, "num_servers": 1},
            "learner": {"device": "cuda", "nproc_per_node": 1, "data_path": "demo:charclass"},
            "weight_sync": {"transport": {"type": "filesystem"}},
        }
    )
    started, seen = tmp_path / "learner-started", tmp_path / "seen.json"

    def learner_command(cfg: TetherConfig, *, resume: bool = False, redis_url: str = "") -> list[str]:
        return [sys.executable, "-c", _LEARNER, redis_url, cfg.run.run_id or "", str(seen), str(started)]

    def rollout_command(cfg: TetherConfig, *, index: int, redis_url: str = "") -> list[str]:
        name = f"rollout-{index}"
        return [sys.executable, "-c", _SERVER, redis_url, cfg.run.run_id or "", name, str(started), str(server_exit)]

    monkeypatch.setattr(launcher, "count_gpus", lambda: 1)
    monkeypatch.setattr(launcher, "check_model_path", lambda cfg: None)
    monkeypatch.setattr("learner.data.check_datasets", lambda cfg: None)
    monkeypatch.setattr(launcher, "learner_command", learner_command)
    monkeypatch.setattr(launcher, "rollout_command", rollout_command)
    assert launcher.plan_devices(cfg, 1).shared
    return cfg


def test_the_learner_starts_after_the_colocated_server_has_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _one_gpu_run(tmp_path, monkeypatch)
    assert launcher.up(cfg) == 0, capsys.readouterr()
    assert json.loads((tmp_path / "seen.json").read_text()) == ["rollout-0"], (
        "the learner started before the rollout server sharing its GPU had loaded and registered"
    )
    assert "starts once their engines have loaded" in capsys.readouterr().out


def test_a_colocated_server_that_fails_to_load_ends_the_run_before_the_learner_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _one_gpu_run(tmp_path, monkeypatch, server_exit=3)
    assert launcher.up(cfg) == 1
    assert "rollout-0 exited with code 3" in capsys.readouterr().err
    assert not (tmp_path / "learner-started").exists()
