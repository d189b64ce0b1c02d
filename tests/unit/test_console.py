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

from tether.commands.console import GenRate, ProgressLine, step_interval, summary_lines
from tether.config import TetherConfig
from tether.metrics import JsonlMetrics, read_metrics
from tether.plots import panels_for, plot_metrics, title_for, validation_keys
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
    sink.log({"val/reward_mean": 0.4, "val/pass@k": 0.5, "val/prompts": 64.0}, step=30)
    sink.close()
    _write_steps(tmp_path / "kl.jsonl", range(1, 5), kl=True)
    panels = {p.ylabel.split("\n")[0]: p for p in panels_for(read_metrics(metrics), cfg)}
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


def _eval_row(step: int, sources: tuple[str, ...]) -> dict:
    """A round's row as :func:`learner.evaluation.summarize` and ``per_source`` write it (and the evaluator's
    ``val/version`` and ``val/latency_s``), at 64 prompts of k=4."""
    from buffer.evaluation import ValResult
    from learner.evaluation import summarize, summarize_by_source
    from tether.v1.trajectory_pb2 import Prompt

    results = [ValResult(round=step, index=i, version=step, rewards=[float(j * 10 + i % 10 < step) for j in range(4)],
                         tokens=32, versions=[step] * 4) for i in range(64)]  # fmt: skip
    prompts = [Prompt(prompt_id=f"val{i}") for i in range(64)]
    for i, prompt in enumerate(prompts):
        if sources:
            prompt.reward_context["data_source"] = sources[i % len(sources)]
    row = {"step": step, "time": T0 + step, **summarize(results, k=4, expected=64)}
    row.update(summarize_by_source(results, prompts, k=4))
    row.update({"val/version": float(step), "val/latency_s": 12.5})
    return row


def test_the_validation_panel_draws_the_scores_only_on_a_0_to_1_axis(tmp_path: Path) -> None:
    """Every ``val/*`` key on one axis put ``val/prompts`` (64) and the latency at the top and the scores in a
    flat line at the bottom: the panel has the scores only, and its axis spans 0–1."""
    cfg = _cfg(tmp_path)
    one = [_eval_row(s, ("charclass",)) for s in (0, 10, 20, 30)]
    assert {"val/prompts", "val/k", "val/latency_s", "val/version", "val/tokens_mean"} <= set(one[0])
    assert validation_keys(one) == ["val/mean@k", "val/pass@k", "val/pass@1", "val/best@k", "val/reward_mean"]
    two = [_eval_row(s, ("openai/gsm8k", "charclass")) for s in (0, 10, 20, 30)]
    keys = validation_keys(two)
    assert keys[5:] == [
        "val/charclass/mean@k",
        "val/charclass/pass@k",
        "val/openai/gsm8k/mean@k",
        "val/openai/gsm8k/pass@k",
    ]  # each source's headline scores, a source with a slash too
    assert not any(k.endswith(("/prompts", "/missing", "/k", "/version", "/latency_s")) for k in keys)

    metrics = tmp_path / "val.jsonl"
    _write_steps(metrics, range(1, 31))
    with metrics.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in two)
    rows = read_metrics(metrics)
    panel = next(p for p in panels_for(rows, cfg) if p.ylabel.startswith("validation"))
    assert panel.ylim == (0.0, 1.0) and [line[0] for line in panel.lines] == [k[4:] for k in keys]
    assert all(0.0 <= v <= 1.0 for line in panel.lines for v in line[2])
    png = plot_metrics(metrics, tmp_path / "curves.png", cfg=cfg)
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_gen_rate_is_true_when_tokens_come_in_bursts() -> None:
    """Groups land in bursts (1,000 tokens every 10 s) and the learner's step comes 4 s after each burst: read
    once a second, the rate over the last second was 0 at every step (what the console printed all run long);
    over the window it is the true 100 tok/s."""
    gen = GenRate(min_window_s=30.0)
    tokens, step, at_steps = 0, 0, []
    for t in range(0, 121):
        if t % 10 == 5:
            tokens += 1000
        if t % 10 == 9:
            step += 1
        rate = gen.add(float(t), float(tokens), str(step))
        if t % 10 == 9 and t > 40:
            at_steps.append(rate)
    assert at_steps and all(90 <= r <= 110 for r in at_steps), at_steps
    # Steps slower than the window (a burst a minute): the window covers whole steps, never 0 at a step.
    gen, tokens, step, at_steps = GenRate(min_window_s=30.0), 0, 0, []
    for t in range(0, 601):
        tokens += 6000 if t % 60 == 5 else 0
        step += t % 60 == 50
        rate = gen.add(float(t), float(tokens), str(step))
        if t % 60 == 50 and t > 200:
            at_steps.append(rate)
    assert at_steps and all(r > 50 for r in at_steps), at_steps
    assert GenRate().add(0.0, 5.0, "-") is None  # one reading says nothing yet


def test_summary_of_a_failed_run_names_the_childs_own_error(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    error = "RuntimeError: learner.use_liger needs a GPU (Liger kernels are Triton); set it to false on CPU"
    lines = summary_lines(cfg, run_paths(cfg).make(), outcome="failed (learner failed at start twice the same way)",
                          started=time.time(), error=("learner", error))  # fmt: skip
    assert "before its first learner step" in lines[0] and lines[1] == f"learner's last error: {error}"
