"""Every tracker of ``run.loggers`` for real: a process logs learner rows through :func:`tether.trackers.build_metrics`
(as learner rank 0 does), a second one resumes the run, and the test reads the curves back through each
library's own reader — ``wandb leet inspect --json`` for W&B's offline run files, ``MlflowClient`` for the
``mlruns`` file store, ``trackio get metric --json`` for trackio's database and TensorBoard's
``EventAccumulator`` — checking values, steps and verl's names, the config each run was given, and that
the resumed process continued the same W&B, MLflow and trackio runs.

W&B, MLflow and trackio come with ``make install-test`` (extras ``wandb``, ``mlflow``, ``trackio``); where one
is missing the test skips, except under ``$CI``, where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tether.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
ALL = ["console", "tensorboard", "wandb", "mlflow", "trackio"]

WRITER = textwrap.dedent("""
    import json, sys
    from tether.config import load_config
    from tether.trackers import build_metrics

    root, steps = sys.argv[1], json.loads(sys.argv[2])
    cfg = load_config(None, ["--run.run_id", "t1", "--run.project_name", "tether-test",
                             "--run.loggers", "[console, tensorboard, wandb, mlflow, trackio]"])
    metrics = build_metrics(root, loggers=cfg.run.loggers, project=cfg.run.project_name, run_name=cfg.run.run_id,
                            config=cfg.model_dump(mode="json"))
    for step in steps:  # a learner row: tether's names
        metrics.log({"loss/pg": step / 8, "reward/mean": step / 4, "actor/ppo_kl": step / 16,
                     "response/length_mean": 10.0 + step, "perf/tokens_per_s": 100.0 * step}, step=step)
    if 3 in steps:  # an evaluation round's results arrive after a later training step, logged at their own step
        metrics.log({"val/pass@k": 0.75}, step=2)
    metrics.close()
""")


def _need(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        reason = f"{module} is not installed (pip install 'tether[{module}]'; make install-test installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI is set, so the tracker tests must run", pytrace=False)
        pytest.skip(reason)


def _env(tmp_path: Path) -> dict[str, str]:
    """The library defaults tether sets, not a developer's own settings; W&B's caches in the test folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    for name in ("CONFIG", "CACHE", "DATA"):
        env[f"WANDB_{name}_DIR"] = str(tmp_path / f"wandb-{name.lower()}")
    return env


def _write(tmp_path: Path, root: Path, steps: list[int]) -> str:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    result = subprocess.run([sys.executable, str(script), str(root), json.dumps(steps)], cwd=REPO, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _wandb_runs(tmp_path: Path, root: Path) -> list[tuple[dict, dict[str, dict[int, float]]]]:
    """Per offline run file, in order: its ``run`` record and {metric: {training/global_step: value}}."""
    out = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        inspect = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                                 env=_env(tmp_path), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert inspect.returncode == 0, inspect.stderr[-3000:]
        records = [json.loads(line) for line in inspect.stdout.splitlines() if line.startswith("{")]
        [run] = [r["run"] for r in records if r["type"] == "run"]
        curves: dict[str, dict[int, float]] = {}
        for r in records:
            if r["type"] == "history":
                item = r["history"]["item"]
                for key, value in item.items():
                    if not key.startswith("_") and key != "training/global_step":
                        curves.setdefault(key, {})[int(item["training/global_step"])] = value
        out.append((run, curves))
    return out


def _trackio(tmp_path: Path, root: Path, *args: str) -> dict:
    env = {**_env(tmp_path), "TRACKIO_DIR": str(root / "trackio")}
    cmd = [sys.executable, "-m", "trackio.cli", "get", *args, "--project", "tether-test", "--run", "t1", "--json"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.slow
def test_each_tracker_gets_the_config_and_verl_curves_and_a_resume_continues_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("wandb", "mlflow", "trackio"):
        _need(module)
    root = tmp_path / "runs" / "t1"
    first = _write(tmp_path, root, [1, 2, 3])
    second = _write(tmp_path, root, [4, 5])  # tether up --resume: a new learner process, the same run folder
    steps = [1, 2, 3, 4, 5]
    pg = {s: s / 8 for s in steps}
    score = {s: s / 4 for s in steps}
    ids = json.loads((root / "trackers.json").read_text())

    # metrics.jsonl: tether's names, untouched
    rows = [r for r in read_metrics(root / "metrics.jsonl") if "loss/pg" in r]
    assert [r["step"] for r in rows] == steps and [r["loss/pg"] for r in rows] == list(pg.values())
    assert not any("actor/pg_loss" in r for r in read_metrics(root / "metrics.jsonl"))

    # console: verl's line format and names on stdout
    assert "step:1 - actor/pg_loss:0.125 - critic/score/mean:0.25 - critic/rewards/mean:0.25" in first
    assert "step:5 - actor/pg_loss:0.625" in second

    # W&B: one offline file per process, both the run whose id trackers.json keeps
    runs = _wandb_runs(tmp_path, root)
    assert len(runs) == 2 and {run["run_id"] for run, _ in runs} == {ids["wandb"]}
    run, _ = runs[0]
    assert run["project"] == "tether-test" and run["display_name"] == "t1"
    config = run["config"]["update"]
    assert config["run"]["loggers"] == ALL and config["algorithm"]["adv_estimator"] == "grpo"
    curves: dict[str, dict[int, float]] = {}
    for _, c in runs:
        for key, values in c.items():
            curves.setdefault(key, {}).update(values)
    assert curves["actor/pg_loss"] == pg
    assert curves["critic/score/mean"] == score and curves["critic/rewards/mean"] == score
    assert curves["response_length/mean"] == {s: 10.0 + s for s in steps}
    assert curves["actor/ppo_kl"] == {s: s / 16 for s in steps}  # verl's name already
    assert curves["perf/tokens_per_s"] == {s: 100.0 * s for s in steps}  # no verl twin: tether's name
    assert curves["val/pass@k"] == {2: 0.75}  # logged after step 3, kept at step 2
    assert "loss/pg" not in curves and "reward/mean" not in curves

    # MLflow: one run in the file store, the config as verl flattens it, every step
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(root / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tether-test")
    [only] = client.search_runs([experiment.experiment_id])
    assert only.info.run_id == ids["mlflow"] and only.info.run_name == "t1" and only.info.status == "FINISHED"
    params = only.data.params
    assert params["run/run_id"] == "t1" and params["run/loggers/list_len"] == "5" and params["run/loggers/2"] == "wandb"

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(ids["mlflow"], key)}

    assert history("actor/pg_loss") == pg and history("critic/score/mean") == score
    assert history("response_length/mean") == {s: 10.0 + s for s in steps}
    assert history("val/pass_at_k") == {2: 0.75}  # verl's MLflow key for an '@'
    assert history("loss/pg") == {}

    # trackio: one run of that name, all steps
    values = _trackio(tmp_path, root, "metric", "--metric", "actor/pg_loss")["values"]
    assert {v["step"]: v["value"] for v in values} == pg
    described = _trackio(tmp_path, root, "run")
    assert described["config"]["run"]["loggers"] == ALL and described["last_step"] == 5
    assert "critic/rewards/mean" in described["metrics"] and "reward/mean" not in described["metrics"]

    # TensorBoard: its own reader, both processes' event files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("actor/pg_loss")} == pg
    assert "loss/pg" not in events.Tags()["scalars"]
