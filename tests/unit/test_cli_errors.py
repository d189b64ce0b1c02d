"""A Redis that is not there is one line naming ``buffer.redis_url``, within seconds, before any process
starts — not a child's traceback, nor a console that shows ``step -`` for minutes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tether.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["up", "learner"])
def test_unreachable_redis_is_one_line_naming_the_setting(command: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = subprocess.run(
        [sys.executable, "-m", "tether", command, "--config", "configs/demo.yaml", "--run.run_id", "no-redis",
         "--run.output_dir", str(tmp_path), "--model.path", str(tiny_model_dir), "--buffer.redis_url", url],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert f"buffer.redis_url: cannot connect to {url}" in line and "start Redis there" in line
    assert not (tmp_path / "no-redis" / "logs").exists() or not any((tmp_path / "no-redis" / "logs").iterdir())


def test_up_over_an_earlier_run_says_resume_and_starts_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Started over at step 0, the learner would face the old run's Redis (its servers hold later versions,
    # admission counts from them) and wait forever; two runs would share one folder's checkpoints.
    folder = tmp_path / "again"
    (folder / "checkpoints" / "step_7").mkdir(parents=True)
    (folder / "config.yaml").write_text("run: {run_id: again}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tether", "up", "--config", "configs/demo.yaml", "--run.run_id", "again",
         "--run.output_dir", str(tmp_path), "--model.path", str(tiny_model_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "checkpoints up to step 7" in line and f"tether up --resume {folder}" in line, line
    assert not (folder / "redis").exists() and not (folder / "logs").exists()  # nothing was started
