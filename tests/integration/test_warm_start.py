"""``tether make-tiny-model DIR --warm-start addition``: the saved model really learned something held out.

A small budget (a narrow model, a few hundred steps, a low target) keeps this to about a minute of CPU;
the accuracy is measured again here from the saved folder, on held-out pairs, so the test fails if the
command saved the untrained weights or evaluated on training pairs only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tether.commands.warm_start import heldout_accuracy

pytestmark = pytest.mark.slow


def test_warm_start_gives_a_model_with_heldout_accuracy(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    args = ["make-tiny-model", str(out), "--hidden", "128", "--layers", "2", "--heads", "4", "--warm-start",
            "addition", "--warm-start-steps", "600", "--warm-start-target", "0.05"]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "tether", *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out accuracy" in result.stderr  # progress is shown while it trains
    record = json.loads((out / "warm_start.json").read_text())
    assert record["task"] == "addition" and 1 <= record["steps"] <= 600
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    greedy = heldout_accuracy(model, tokenizer, n=128, temperature=0.0)
    assert greedy > 0.0
    assert greedy == pytest.approx(record["heldout_accuracy_greedy"], abs=0.1)  # same held-out set, same model


def test_warm_start_of_an_unknown_task_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tether", "make-tiny-model", str(tmp_path / "m"), "--warm-start", "chess"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--warm-start: unknown task 'chess'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m").exists()  # refused before anything was built
