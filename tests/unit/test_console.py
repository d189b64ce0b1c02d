"""What a person sees of a run without a terminal: step lines, warnings, the closing summary, the plot.

``tether up``'s console used to print a line only every 10 s when its output was not a terminal, so a
short run showed no step at all, and nothing summed the run up at its end; the plot had raw key names,
no title and ``loss/total`` drawn twice when it equals ``loss/pg``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

from tether.commands.console import ProgressLine, step_interval, summary_lines
from tether.config import TetherConfig
from tether.metrics import JsonlMetrics, read_metrics
from tether.plots import panels_for, plot_metrics, title_for
from tether.redis_server import free_port
from tether.runs import run_paths

REPO = Path(__file__).resolve().parents[2]
T0 = time.time()


def _cfg(tmp_path: Path, total_steps: int = 12) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "run": {"run_id": "console", "output_dir": str(tmp_path)},
            "buffer": {"redis_url": f"redis://127.0.0.1:{free_port()}/0"},  # nobody there: the file is enough
            "learner": {"total_steps": total_steps, "train_batch_size": 2},
            "rollout": {"n": 4},
        }
    )


def _write_steps(path: Path, steps: range, *, kl: bool = False) -> None:
    """Rows as the learner writes them, one every 0.1 s of (pretend) wall clock."""
    with path.open("a") as f:
        for s in steps:
            loss = 0.5 / s
            row = {"step": s, "time": T0 + 0.1 * s, "reward/mean": s / 20, "loss/pg": loss,
                   "loss/total": loss + (0.1 if kl else 0.0), "learner/version": s, "staleness/mean": 1.0,
                   "staleness/max": 1.0, "data/groups": 2, "timing/step": 0.1, "actor/entropy": 2.0}  # fmt: skip
            f.write(json.dumps(row) + "\n")


def test_step_interval_is_round_and_short() -> None:
    assert [step_interval(n) for n in (6, 15, 60, 100, 1000, 10_000)] == [1, 1, 5, 10, 100, 1000]


def test_without_a_terminal_every_nth_step_and_the_first_and_last_are_printed(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    metrics = run_paths(cfg).make().metrics
    out = io.StringIO()  # not a terminal
    progress = ProgressLine(cfg, out=out, metrics_path=metrics, every_steps=5)
    _write_steps(metrics, range(1, 8))
    progress.update()
    _write_steps(metrics, range(8, 13))
    progress.finish()
    steps = [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert steps == ["1/12", "5/12", "10/12", "12/12"]
    assert "reward 0.600" in out.getvalue()  # step 12's own reward, not whatever Redis said a second ago
    assert "\r" not in out.getvalue()


def test_rows_of_an_earlier_lifetime_are_not_reprinted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, total_steps=20)
    metrics = run_paths(cfg).make().metrics
    _write_steps(metrics, range(1, 11))  # lifetime 1
    out = io.StringIO()
    progress = ProgressLine(cfg, out=out, metrics_path=metrics, every_steps=5)
    _write_steps(metrics, range(11, 14))
    progress.finish()
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["11/20", "13/20"]


def test_redis_unreachable_is_a_warning_naming_the_setting(tmp_path: Path) -> None:
    out = io.StringIO()
    progress = ProgressLine(_cfg(tmp_path), out=out, quiet_every_s=1e9)
    for _ in range(4):
        progress.update()
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("tether: warning:")]
    assert len(warnings) == 1  # said once, not every second
    assert "unreachable" in warnings[0] and "buffer.redis_url" in warnings[0]


def test_summary_names_steps_reward_throughput_and_where_things_are(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    paths = run_paths(cfg).make()
    started = T0
    _write_steps(paths.metrics, range(1, 13))
    (paths.plots / "curves.png").write_bytes(b"png")
    (paths.root / "buffer_stats.json").write_text("{}")
    text = "\n".join(summary_lines(cfg, paths, outcome="finished", started=started))
    assert "run console finished after" in text
    assert "12 learner steps (1 → 12 of 12)" in text
    assert "reward 0.050 → 0.600" in text
    assert "80.0 samples/s" in text  # 12 steps × 2 groups × n=4 in 12 × 0.1 s
    assert str(paths.plots / "curves.png") in text and str(paths.root / "buffer_stats.json") in text


def test_summary_of_a_run_that_never_stepped(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    lines = summary_lines(cfg, run_paths(cfg).make(), outcome="interrupted", started=time.time())
    assert "interrupted" in lines[0] and "before its first learner step" in lines[0]


def test_plot_panels_titles_and_no_duplicate_loss(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    metrics = tmp_path / "m.jsonl"
    _write_steps(metrics, range(1, 30))
    panels = panels_for(read_metrics(metrics), cfg)
    labels = {p.ylabel.split("\n")[0]: [line[0] for line in p.lines] for p in panels}
    assert labels["policy-gradient"] == ["policy-gradient loss"]  # loss/total == loss/pg: one curve, not two panels
    assert labels["reward"] == ["per step", "smoothed"]
    assert {"staleness", "samples/s", "entropy"} <= set(labels)
    assert "validation" not in labels
    assert "console" in title_for(cfg) and "max_staleness" in title_for(cfg)

    sink = JsonlMetrics(metrics)
    sink.log({"val/reward_mean": 0.4, "val/pass@k": 0.5}, step=30)
    sink.close()
    _write_steps(tmp_path / "kl.jsonl", range(1, 5), kl=True)
    panels = {p.ylabel: p for p in panels_for(read_metrics(metrics), cfg)}
    assert [line[0] for line in panels["validation"].lines] == ["pass@k", "reward_mean"]
    loss = next(p for p in panels_for(read_metrics(tmp_path / "kl.jsonl"), cfg) if p.ylabel == "loss")
    assert [line[0] for line in loss.lines] == ["total loss", "policy-gradient loss"]
    png = plot_metrics(metrics, tmp_path / "curves.png", cfg=cfg)
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_version_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "tether", "--version"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("tether 0.")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_live_line_and_warnings_above_it(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    out = _Terminal()
    progress = ProgressLine(cfg, out=out, metrics_path=run_paths(cfg).make().metrics)
    progress.update()
    progress.update()
    progress.update()  # the third failed read in a row: the Redis warning
    progress.update()
    progress.finish()
    text = out.getvalue()
    assert text.count("\rredis: unreachable") == 4  # the live line, rewritten in place
    warning = next(line for line in text.split("\n") if "tether: warning:" in line)
    cleared, shown = warning.rsplit("\r", 1)
    assert cleared.endswith("\r" + " " * len("redis: unreachable"))  # the live line was blanked first
    assert shown.startswith("tether: warning: Redis at")
    assert text.endswith("\n")  # the shell prompt starts on a line of its own
