"""Trackers, the parts that need no tracker library: ``run.loggers``,
the error a missing extra gives, verl's names and their table in docs/TRACKERS.md, and the config flattened
for MLflow as verl's own code flattens it. The libraries themselves: tests/integration/test_trackers.py."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import get_args

import pytest

from tether.config import ConfigError, load_config
from tether.config.run import LoggerName
from tether.metrics import read_metrics
from tether.trackers import TRACKERS, TrackerUnavailable, build_metrics, mlflow_key, mlflow_params, shareable
from tether.verl_names import VERL_NAMES, to_verl_names

REPO = Path(__file__).resolve().parents[2]


def test_default_loggers_are_console_and_tensorboard() -> None:
    run = load_config(None, []).run
    assert run.loggers == ["console", "tensorboard"] and run.project_name == "tether"
    assert "tensorboard" not in run.model_dump()


def test_loggers_as_verl_writes_them() -> None:
    assert load_config(None, ["--run.loggers", "wandb"]).run.loggers == ["wandb"]  # verl: logger: console
    assert load_config(None, ["--run.loggers", "[console, mlflow, console]"]).run.loggers == ["console", "mlflow"]
    with pytest.raises(ConfigError, match=r"run\.loggers\.1: .*'trackio' \(got 'swanlab'\)"):
        load_config(None, ["--run.loggers", "[console, swanlab]"])


def test_the_old_tensorboard_switch_is_an_unknown_key() -> None:
    with pytest.raises(ConfigError, match=r"run\.tensorboard: unknown key"):
        load_config(None, ["--run.tensorboard", "false"])


def test_every_logger_name_has_a_tracker() -> None:
    assert set(get_args(LoggerName)) == set(TRACKERS)


@pytest.mark.parametrize(("module", "extra"), [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio")])
def test_a_missing_package_names_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what `import module` sees when it is not installed
    message = rf"run\.loggers: '{module}' needs the {module} package, which is not installed: " + re.escape(
        f"pip install 'tether[{extra}]'"
    )
    for rank in (0, 1):  # every rank stops, before anything is written
        with pytest.raises(TrackerUnavailable, match=message):
            build_metrics(tmp_path / "run", rank=rank, loggers=["console", module])
    assert not (tmp_path / "run").exists()


def test_console_prints_verl_names_and_jsonl_keeps_tethers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    metrics = build_metrics(tmp_path, loggers=["console"])
    metrics.log({"loss/pg": 0.25, "reward/mean": 0.5, "actor/ppo_kl": 0.125, "x": float("nan")}, step=3)
    metrics.close()
    line = capsys.readouterr().out.strip()
    assert line == "step:3 - actor/pg_loss:0.25 - critic/score/mean:0.5 - critic/rewards/mean:0.5 - actor/ppo_kl:0.125"
    [row] = read_metrics(tmp_path / "metrics.jsonl")
    assert row["loss/pg"] == 0.25 and row["reward/mean"] == 0.5 and "actor/pg_loss" not in row


def test_renaming() -> None:
    out = to_verl_names({"loss/pg": 1.0, "reward/mean": 2.0, "timing/step": 3.0, "actor/entropy": 4.0, "mine": 5.0})
    assert out == {
        "actor/pg_loss": 1.0,
        "critic/score/mean": 2.0,
        "critic/rewards/mean": 2.0,
        "timing_s/step": 3.0,
        "perf/time_per_step": 3.0,
        "actor/entropy": 4.0,
        "mine": 5.0,
    }


def test_the_docs_table_is_the_map() -> None:
    """docs/TRACKERS.md lists every renamed key, each row `tether key` | `verl name`, `verl name`."""
    text = (REPO / "docs" / "TRACKERS.md").read_text(encoding="utf-8").split("## Curve names", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| (`[^|]+`) \|", text, flags=re.MULTILINE)
    table = {key: tuple(re.findall(r"`([^`]+)`", names)) for key, names in rows}
    assert table == VERL_NAMES


def test_mlflow_keys_as_verl_sanitises_them() -> None:
    assert mlflow_key("val/pass@k") == "val/pass_at_k"
    assert mlflow_key("a//b c:d?e") == "a/b c:d_e"


def test_trackers_never_get_the_secrets() -> None:
    overrides = ["--buffer.redis_url", "redis://me:s3cret@127.0.0.1:6379/0", "--rollout.auth_token", "abc"]
    overrides += ["--rollout.reward.type", "remote", "--rollout.reward.address", "h:1", "--rollout.reward.token", "xyz"]
    config = shareable(load_config(None, overrides).model_dump(mode="json"))
    assert config["buffer"]["redis_url"] == "redis://me:***@127.0.0.1:6379/0"
    assert config["rollout"]["auth_token"] == "***" and config["rollout"]["reward"]["token"] == "***"
    assert config["rollout"]["reward"]["address"] == "h:1" and config["rollout"]["tls_key"] == ""
    assert "s3cret" not in str(config) and "xyz" not in str(config)


def _verl_tracking():
    """verl's ``verl/utils/tracking.py``, loaded from its file (it needs no other verl module, nor ray)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        reason = "verl is not installed (make install-test installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI is set, so this comparison must run", pytrace=False)
        pytest.skip(reason)
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "tracking.py"
    module_spec = importlib.util.spec_from_file_location("_verl_tracking", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_mlflow_params_are_the_config_flattened_as_verl_does() -> None:
    config = load_config(None, ["--run.run_id", "r1", "--run.loggers", "[console, mlflow]"]).model_dump(mode="json")
    ours = mlflow_params(config)
    theirs = _verl_tracking()._compute_mlflow_params_from_objects(config)
    assert ours == {mlflow_key(k): str(v)[:6000] for k, v in theirs.items()}
    assert ours["run/loggers/list_len"] == "2" and ours["run/loggers/1"] == "mlflow"
    assert ours["run/run_id"] == "r1"
