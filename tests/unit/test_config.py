"""Config: layering, tagged unions, errors that name the key, the resolved config on disk."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tether.config import ConfigError, TetherConfig, load_config, parse_overrides, save_resolved
from tether.config.rollout import VllmEngineConfig
from tether.config.weight_sync import GlooTransport

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_validate() -> None:
    cfg = TetherConfig()
    assert cfg.algorithm.max_staleness == 1
    assert cfg.rollout.engine.type == "transformers"
    assert cfg.weight_sync.transport.type == "filesystem"


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "learner:\n  lr: 1.0e-5\n  total_steps: 7\nrollout:\n  engine:\n    type: vllm\n")
    overrides = ["--learner.lr", "3e-6", "--rollout.engine.max_num_seqs=12", "--algorithm.max_staleness", "0"]
    cfg = load_config(path, overrides)
    assert cfg.learner.lr == pytest.approx(3e-6)
    assert cfg.learner.total_steps == 7  # from the file, untouched by overrides
    assert isinstance(cfg.rollout.engine, VllmEngineConfig)
    assert cfg.rollout.engine.max_num_seqs == 12
    assert cfg.algorithm.max_staleness == 0


def test_tagged_union_switch_by_override() -> None:
    cfg = load_config(None, ["--weight_sync.transport.type", "gloo", "--weight_sync.transport.master_port", "0"])
    assert isinstance(cfg.weight_sync.transport, GlooTransport)
    assert cfg.weight_sync.transport.master_port == 0


def test_parse_overrides_nests_and_types() -> None:
    assert parse_overrides(["--a.b.c", "1", "--a.d=true", "--e", "x"]) == {"a": {"b": {"c": 1}, "d": True}, "e": "x"}
    with pytest.raises(ConfigError, match="missing value"):
        parse_overrides(["--a.b"])
    with pytest.raises(ConfigError, match=r"expected --section\.key"):
        parse_overrides(["positional"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--learner.lrr", "1"], r"^learner\.lrr: unknown key — did you mean 'lr'\?$"),
        (["--nosuch.x", "1"], r"^nosuch: unknown key"),
        (["--learner.lr", "-1"], r"^learner\.lr: Input should be greater than 0 \(got -1\)$"),
        (["--learner.total_steps", "many"], r"^learner\.total_steps: Input should be a valid integer"),
        (["--rollout.top_p", "1.5"], r"^rollout\.top_p: Input should be less than or equal to 1"),
        (["--rollout.engine.type", "tgi"], r"^rollout\.engine\.type: Input tag 'tgi'"),
        (
            ["--rollout.engine.type", "vllm", "--rollout.engine.gpu_memory_utilization", "1.5"],
            r"^rollout\.engine\.gpu_memory_utilization: Input should be less than or equal to 1",
        ),
        (["--rollout.engine.gpu_memory_utilization", "0.5"], r"^rollout\.engine\.gpu_memory_utilization: unknown key"),
        (["--rollout.reward.type", "remote"], r"^rollout\.reward\.address: Field required$"),
        (["--run.run_id", "has space"], r"^run\.run_id: must be"),
        (["--learner.ppo_mini_batch_size", "3"], r"^learner: ppo_mini_batch_size \(3\) must divide"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "learner:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: malformed YAML at line \d+, column \d+"):
        load_config(path)


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["--run.run_id", "r1", "--rollout.engine.type", "vllm", "--learner.lr", "2e-6"])
    out = save_resolved(cfg, tmp_path / "run")
    again = load_config(out)
    assert again == cfg
    assert yaml.safe_load(out.read_text())["rollout"]["engine"]["type"] == "vllm"


def test_every_field_is_documented() -> None:
    from pydantic import BaseModel

    undocumented = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if name == "type":
                continue
            sub = [
                a
                for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ]
            if sub:
                for s in sub:
                    walk(s, f"{prefix}{name}.")
            elif not field.description:
                undocumented.append(prefix + name)

    walk(TetherConfig, "")
    assert not undocumented, f"fields without a docstring: {undocumented}"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tether", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


@pytest.mark.parametrize(
    ("content", "overrides", "needle"),
    [
        ("learner: {lr: -1}\n", [], "learner.lr: Input should be greater than 0 (got -1)"),
        ("learner:\n  lr: [1\n", [], "malformed YAML at line"),
        ("learner: {}\n", ["--learner.bogus", "1"], "learner.bogus: unknown key"),
        ("rollout: {n: 'eight'}\n", [], "rollout.n: Input should be a valid integer"),
    ],
)
def test_cli_config_error_is_one_line_exit_2(tmp_path: Path, content: str, overrides: list[str], needle: str) -> None:
    result = run_cli("config", "--config", str(write(tmp_path, content)), *overrides)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_entry_point_rejects_bad_config_before_importing_torch(tmp_path: Path) -> None:
    bad = write(tmp_path, "learner: {lr: 0}\n")
    code = (
        "import sys; from tether.commands.cli import main\n"
        f"rc = main(['learner', '--config', {str(bad)!r}, '--run.run_id', 'x'])\n"
        "assert rc == 2, rc\n"
        "assert 'torch' not in sys.modules, 'torch imported before the config was validated'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr


def test_separate_launch_requires_run_id(tmp_path: Path) -> None:
    result = run_cli("rollout", "--config", str(write(tmp_path, "{}\n")))
    assert result.returncode == 2
    assert "run.run_id: required" in result.stderr


def test_cli_help_for_every_command() -> None:
    for command in ("up", "learner", "rollout", "status", "config", "make-tiny-model"):
        result = run_cli(command, "--help")
        assert result.returncode == 0, (command, result.stderr)
        assert "usage: tether" in result.stdout


def test_cli_prints_resolved_config(tmp_path: Path) -> None:
    result = run_cli("config", "--learner.lr", "5e-6")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["learner"]["lr"] == pytest.approx(5e-6)


def test_learner_max_prompt_length_follows_rollout_max_prompt_len_unless_set() -> None:
    """One limit under verl's name and the servers': empty follows the servers'; given alone, the servers take it."""
    cfg = load_config(None, ["--rollout.max_prompt_len", "64"])
    assert cfg.learner.max_prompt_length is None and cfg.prompt_limit == (64, "rollout.max_prompt_len")
    cfg = load_config(None, ["--learner.max_prompt_length", "2048"])
    assert cfg.rollout.max_prompt_len == 2048 and cfg.prompt_limit == (2048, "learner.max_prompt_length")
    # both given: the learner's may be lower (it truncates or filters to its tighter limit) ...
    cfg = load_config(None, ["--learner.max_prompt_length", "32", "--rollout.max_prompt_len", "64"])
    assert cfg.prompt_limit == (32, "learner.max_prompt_length") and cfg.rollout.max_prompt_len == 64
    # ... and the resolved config (what every process of the run reads) keeps the one limit
    again = TetherConfig.model_validate(yaml.safe_load(yaml.safe_dump(load_config(
        None, ["--learner.max_prompt_length", "300"]).model_dump(mode="json"))))  # fmt: skip
    assert (again.rollout.max_prompt_len, again.prompt_limit) == (300, (300, "learner.max_prompt_length"))


def test_a_learner_prompt_limit_above_the_servers_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--learner.max_prompt_length", "512", "--rollout.max_prompt_len", "64"])
    message = str(e.value)
    assert "learner.max_prompt_length (512)" in message and "rollout.max_prompt_len (64)" in message


def test_stuck_timeout_defaults_on_and_zero_turns_it_off() -> None:
    assert TetherConfig().learner.stuck_timeout_s == 60
    assert load_config(None, ["--learner.stuck_timeout_s", "0"]).learner.stuck_timeout_s == 0
    with pytest.raises(ConfigError, match=r"learner\.stuck_timeout_s"):
        load_config(None, ["--learner.stuck_timeout_s", "-1"])


def test_vllm_max_lora_rank_is_one_vllm_accepts() -> None:
    """vLLM 0.32 refuses any max_lora_rank outside its list at engine start; the config says so first."""
    from pydantic import ValidationError

    from tether.config.rollout import VLLM_LORA_RANKS

    assert VllmEngineConfig(max_lora_rank=320).max_lora_rank == 320
    with pytest.raises(ValidationError, match=r"not 48; the next one up is 64"):
        VllmEngineConfig(max_lora_rank=48)
    with pytest.raises(ValidationError, match="not 1024"):
        VllmEngineConfig(max_lora_rank=1024)
    assert 64 in VLLM_LORA_RANKS  # the default


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_lora_ranks_are_vllms_own() -> None:
    from vllm.config.lora import MaxLoRARanks

    from tether.config.rollout import VLLM_LORA_RANKS

    assert set(VLLM_LORA_RANKS) == set(MaxLoRARanks.__args__)
