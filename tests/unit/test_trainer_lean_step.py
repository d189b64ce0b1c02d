"""The lean learner step gives the numbers the plain one gave, bit for bit.

Each lever of issue 23's lean step claims to be numerically neutral: one host sync for the step's metrics
(:class:`learner.trainer.MetricSums`), gradient clipping on the local tensors of a one-rank FSDP2 mesh
(:func:`learner.trainer.clip_grad_norm`) and NumPy-built micro-batches (:mod:`learner.packing`). The
reference is the code they replace — ``clip_grad_norm_`` on the DTensors, a tensor per sample and field,
a ``float()`` per metric — swapped back in for a second trainer on the same model,
the same groups and a real one-rank gloo group with FSDP2, and the two must agree exactly.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch


def test_metric_sums_equal_python_floats_added_one_by_one() -> None:
    from learner.trainer import MetricSums

    rng = random.Random(0)
    keys = ["loss/pg", "actor/iw_max", "actor/clipfrac", "loss/total"]
    batches = [{k: torch.tensor(rng.uniform(-3, 3), dtype=torch.float32) for k in keys} for _ in range(5)]
    del batches[2]["actor/clipfrac"]  # a key a micro-batch did not report counts as 0, as before
    want: dict[str, float] = {}
    for m in batches:
        for k, v in m.items():
            v = float(v)
            want[k] = max(want.get(k, 0.0), v) if k.endswith("_max") else want.get(k, 0.0) + v
    sums = MetricSums(keys, torch.device("cpu"))
    for m in batches:
        sums.add(m)
    got = sums.read(n_updates=2)
    assert got == {k: (v if k.endswith("_max") else v / 2) for k, v in want.items()}
    sums.skipped = 1
    assert sums.read(n_updates=2)["learner/skipped_updates"] == 1.0


def _reference_micro_batch(samples, index, *, packed, pad_id=0, share_prompts=False):  # type: ignore[no-untyped-def]
    """The micro-batch as the plain step built it: a tensor per sample and field, then ``torch.cat``."""
    from learner.packing import MicroBatch

    chosen = [samples[i] for i in index]
    lengths = [s.length for s in chosen]
    width = sum(lengths) if packed else max(lengths)
    rows, logit_index, targets, seq_ids, offset = [], [], [], [], 0
    for k, s in enumerate(chosen):
        ids = torch.tensor(np.asarray(s.input_ids, dtype=np.int64))
        rows.append(ids)
        logit_index.append(torch.arange(s.prompt_len - 1, s.length - 1) + (offset if packed else k * width))
        targets.append(ids[s.prompt_len :])
        seq_ids.append(torch.full((s.num_completion,), k, dtype=torch.long))
        offset += s.length
    assert packed and not share_prompts, "the step under test packs its rows, a copy of the prompt per sample"
    return MicroBatch(
        input_ids=torch.cat(rows)[None],
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        attention_mask=None,
        logit_index=torch.cat(logit_index),
        targets=torch.cat(targets),
        seq_ids=torch.cat(seq_ids),
        sample_index=list(index),
        packed=packed,
        seq_lengths=lengths,
    )


def _reference_per_token(samples, index, name):  # type: ignore[no-untyped-def]
    parts = []
    for i in index:
        value = getattr(samples[i], name)
        if np.ndim(value) == 0:
            parts.append(torch.full((samples[i].num_completion,), float(value), dtype=torch.float32))
        else:
            parts.append(torch.tensor(np.asarray(value, dtype=np.float32)))
    return torch.cat(parts)


def _steps(
    model_dir: Path, steps: int = 2, *, share_prompts: bool = False
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Metrics per step and the weights after them (``share_prompts``: the learner's knob)."""
    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tether.config import TetherConfig

    cfg = TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 8},
            "learner": {"train_batch_size": 4, "lr": 3e-3, "lr_warmup_steps": 0, "grad_clip": 0.1,
                        "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8, "device": "cpu",
                        "share_prompts": share_prompts},
            "algorithm": {"max_staleness": 1, "loss_agg_mode": "token-mean"},
        }
    )  # fmt: skip
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, torch.device("cpu")), cfg, torch.device("cpu"), shard=True)
    trainer = Trainer(cfg, model, device=torch.device("cpu"), ref_model=None)
    metrics = []
    for step in range(steps):
        # Random behaviour log-probs: the importance weights are truncated, so every metric is exercised.
        out = trainer.train_step(make_groups(4, 4, vocab=model.config.vocab_size, seed=step), version=1, step=step)
        out.pop("timing/compute")
        metrics.append(out)
    weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return metrics, weights


def test_lean_step_is_bit_identical_to_the_plain_step(
    one_rank: None, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import learner.trainer as trainer_module

    lean, lean_weights = _steps(model_dir)
    clip = trainer_module.clip_grad_norm
    monkeypatch.setattr(trainer_module, "clip_grad_norm", lambda model, max_norm, world: clip(model, max_norm, world=2))
    monkeypatch.setattr(trainer_module, "make_micro_batch", _reference_micro_batch)
    monkeypatch.setattr(trainer_module, "per_token", _reference_per_token)
    plain, plain_weights = _steps(model_dir)
    assert lean == plain  # every metric of both steps, grad norm and losses included, exactly
    assert lean[0]["actor/grad_norm"] > 0.1  # clipping really scaled the gradients
    for name, weight in plain_weights.items():
        assert torch.equal(lean_weights[name], weight), name
