"""One optimizer update per step needs no separate forward for the proximal log-probs.

The reference is the separate forward-only pass (``reuse_update_forward = False``); both ways must give
the same loss, metrics and gradients, and the fused way must run the model only for the update. A
forward pre-hook on the model counts its calls, so the counts here fail on a trainer that always runs
the extra pass. Runs a real single-rank gloo process group and the real tiny model; no FSDP needed at
one rank for these numerics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close


def _run(model_dir: Path, *, reuse: bool, learner: dict | None = None, steps: int = 1):
    """(metrics per step, grads of the first update, model calls per step) for a fresh trainer."""
    from learner.parallelize import load_model
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tether.config import TetherConfig

    cfg = TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 24},
            "learner": {
                "train_batch_size": 4,
                "lr": 1e-2,
                "lr_warmup_steps": 0,
                "use_dynamic_bsz": False,
                "micro_batch_size_per_gpu": 4,
                **(learner or {}),
            },
            "algorithm": {"entropy_coeff": 0.01, "max_staleness": 1},
        }
    )
    torch.manual_seed(0)
    model = load_model(cfg, torch.device("cpu"))
    trainer = Trainer(cfg, model, device=torch.device("cpu"), ref_model=None)
    trainer.reuse_update_forward = reuse
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    grads: dict[str, torch.Tensor] = {}

    def keep_first_grads(*_) -> None:  # the accumulated (and clipped) gradients of the first update
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(keep_first_grads)
    metrics, counts = [], []
    for step in range(steps):
        calls[0] = 0
        # Behaviour log-probs are random, so the importance weights are far from 1 and get truncated:
        # the fused path must reproduce that correction, not only the ratio of 1.
        metrics.append(trainer.train_step(make_groups(4, 4, vocab=256, seed=step), version=1))
        counts.append(calls[0])
    return metrics, grads, counts, trainer


KEYS = ("loss/total", "loss/pg", "loss/entropy", "actor/iw_mean", "actor/iw_capped_frac", "actor/clipfrac",
        "actor/ppo_kl", "actor/grad_norm")  # fmt: skip


def test_one_update_reuses_its_forward(one_rank: None, model_dir: Path) -> None:
    ref, ref_grads, ref_calls, ref_trainer = _run(model_dir, reuse=False, steps=2)
    fused, fused_grads, fused_calls, trainer = _run(model_dir, reuse=True, steps=2)
    for a, b in zip(ref, fused, strict=True):
        for key in KEYS:
            assert_close(b[key], a[key], msg=key)
    assert fused_grads.keys() == ref_grads.keys() and fused_grads
    for name in ref_grads:
        assert_close(fused_grads[name], ref_grads[name], msg=name)
    # 16 samples, 4 per update micro-batch, 8 per forward-only micro-batch: the reference runs the model
    # 4 + 2 times a step, the fused trainer 4 times.
    assert ref_calls == [6, 6]
    assert fused_calls == [4, 4]
    assert trainer.extra_forward_passes == 0 and ref_trainer.extra_forward_passes == 1


@pytest.mark.parametrize("learner", [{"ppo_epochs": 2}, {"ppo_mini_batch_size": 2}])
def test_policy_changing_within_the_step_keeps_the_separate_pass(
    one_rank: None, model_dir: Path, learner: dict
) -> None:
    ref, _, ref_calls, _ = _run(model_dir, reuse=False, learner=learner)
    out, _, calls, trainer = _run(model_dir, reuse=True, learner=learner)
    assert calls == ref_calls  # the forward-only pass still runs
    assert trainer.extra_forward_passes == 1
    for key in KEYS:
        assert_close(out[0][key], ref[0][key], msg=key)
