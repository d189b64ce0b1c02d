"""An attention setting the box cannot run is refused by ``tether up`` before any process starts (issue 43).

It used to be refused inside the learner, after torchrun had started and the rollout servers had loaded their
engines — then restarted three times. The check is the learner's own (:mod:`learner.attention_check`), so the
message is the one the learner would give; here it comes in a second, naming the setting to change.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from learner.attention_check import AttentionUnavailable, check_attention, installed_torch
from learner.parallelize import attn_implementation, varlen_kernel
from tether.commands.launcher import check_attention as preflight
from tether.config import ConfigError, TetherConfig

REPO = Path(__file__).resolve().parents[2]
FLASH_ON_CPU = "model.attn_implementation: flash_attention_2 needs a GPU; use sdpa on CPU"


def _cfg(**learner: object) -> TetherConfig:
    attn = learner.pop("attn", "sdpa")
    return TetherConfig.model_validate({"model": {"path": "unused", "attn_implementation": attn}, "learner": learner})


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_cfg(attn="flash_attention_2"), FLASH_ON_CPU),
        (_cfg(attn="flash_attention_2", ulysses_sequence_parallel_size=2), FLASH_ON_CPU),
        (_cfg(varlen_attention="torch"), "learner.varlen_attention: torch needs CUDA"),
    ],
    ids=["flash", "flash-ulysses", "varlen-torch"],
)
def test_up_refuses_what_the_learner_would_with_its_message(cfg: TetherConfig, message: str) -> None:
    """No GPU here (``learner.device: auto`` with none counted, or ``cpu``): the learner's message, as a config
    error of ``tether up``."""
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError) as learner_said:
        attn_implementation(cfg, cpu)
    assert str(learner_said.value).startswith(message)
    with pytest.raises(ConfigError) as up_said:
        preflight(cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"device": "cpu"})}), 8)
    assert str(up_said.value) == str(learner_said.value)


def test_what_can_run_passes() -> None:
    for cfg in (_cfg(), _cfg(attn="eager"), _cfg(use_remove_padding=False), _cfg(attn="sdpa", device="cpu")):
        preflight(cfg, 0)
    # On a GPU: flash-attn present or not decides flash_attention_2; torch's varlen kernel needs bf16 and 2.10.
    has_flash = importlib.util.find_spec("flash_attn") is not None
    try:
        check_attention(_cfg(attn="flash_attention_2"), cuda=True, torch_varlen=False, torch_version="2.13")
        assert has_flash
    except AttentionUnavailable as e:
        assert not has_flash and "flash-attn package" in str(e)
    check_attention(_cfg(varlen_attention="torch"), cuda=True, torch_varlen=True, torch_version="2.13")
    with pytest.raises(AttentionUnavailable, match="param_dtype float32"):
        check_attention(_cfg(varlen_attention="torch", param_dtype="float32"), cuda=True, torch_varlen=True,
                        torch_version="2.13")  # fmt: skip
    # the version installed, read without importing it, and whether it has the varlen kernel
    assert installed_torch() == (torch.__version__, importlib.util.find_spec("torch.nn.attention.varlen") is not None)


def test_the_learner_keeps_its_messages() -> None:
    """The checks moved to :mod:`learner.attention_check`; the learner says what it said before."""
    cpu = torch.device("cpu")
    assert varlen_kernel(_cfg(), cpu) == "split"
    said = f"(device cpu, torch {torch.__version__}, param_dtype auto); use split"
    with pytest.raises(RuntimeError, match=re.escape(said)):
        varlen_kernel(_cfg(varlen_attention="torch"), cpu)


def test_tether_up_refuses_flash_attention_on_cpu_before_starting_anything(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever the machine has
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tether", "up", "--config", "configs/demo.yaml", "--run.run_id", "flash",
         "--run.output_dir", str(tmp_path), "--model.path", str(tiny_model_dir),
         "--model.attn_implementation", "flash_attention_2"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == f"tether: config error: {FLASH_ON_CPU}"
    assert not (tmp_path / "flash").exists()  # no run folder: nothing was started
    assert time.monotonic() - started < 60
