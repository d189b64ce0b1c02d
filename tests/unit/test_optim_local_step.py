"""AdamW stepped on the local shards (:class:`learner.optim.LocalAdamW`) gives DTensor AdamW's numbers.

The reference is the same optimizer with ``local_step`` off (torch's AdamW through DTensor dispatch), on
the same model, groups and a real one-rank gloo group with FSDP2: metrics and weights must agree bit for
bit, and the fused kernel must really have been handed plain tensors. A checkpoint written by one resumes
the other to the same next step (the state format is torch's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor


def _trainer(model_dir: Path):  # type: ignore[no-untyped-def]
    from learner.parallelize import load_model, parallelize
    from learner.trainer import Trainer
    from tether.config import TetherConfig

    cfg = TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 8},
            "learner": {"train_batch_size": 4, "lr": 3e-3, "lr_warmup_steps": 0, "weight_decay": 0.1,
                        "device": "cpu"},
            "algorithm": {"max_staleness": 1, "loss_agg_mode": "token-mean"},
        }
    )  # fmt: skip
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, torch.device("cpu")), cfg, torch.device("cpu"), shard=True)
    return Trainer(cfg, model, device=torch.device("cpu"), ref_model=None)


def _step(trainer, step: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from learner.synthetic import make_groups

    groups = make_groups(4, 4, vocab=trainer.model.config.vocab_size, seed=step)
    out = trainer.train_step(groups, version=1, step=step)
    out.pop("timing/compute")
    return out


def _weights(trainer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}


def test_local_step_is_bit_identical_to_dtensor_adamw(
    one_rank: None, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner.optim import LocalAdamW

    kernel, seen = torch._fused_adamw_, []

    def spy(params, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(any(isinstance(p, DTensor) for p in params))
        return kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    results = {}
    for local in (True, False):
        monkeypatch.setattr(LocalAdamW, "local_step", local)
        seen.clear()
        trainer = _trainer(model_dir)
        metrics = [_step(trainer, step) for step in range(3)]
        results[local] = metrics, _weights(trainer)
        assert seen == [not local] * 3  # local: plain tensors reached the kernel; reference: DTensors
    (lean, lean_w), (plain, plain_w) = results[True], results[False]
    assert lean == plain
    assert lean[2]["loss/pg"] != lean[0]["loss/pg"]  # the weights really moved between steps
    for name, weight in plain_w.items():
        assert torch.equal(lean_w[name], weight), name


def test_checkpoint_of_local_step_resumes_dtensor_adamw(
    one_rank: None, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from learner.optim import LocalAdamW

    saved = _trainer(model_dir)
    for step in range(2):
        _step(saved, step)
    t = saved
    path = save_checkpoint(tmp_path, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
                           state=TrainState(step=2))  # fmt: skip
    assert all(isinstance(s["exp_avg"], DTensor) for s in t.optimizer.state.values())  # torch's state format
    want = _step(saved, 2)

    monkeypatch.setattr(LocalAdamW, "local_step", False)
    resumed = _trainer(model_dir)
    r = resumed
    load_checkpoint(path, model=r.model, optimizer=r.optimizer, scheduler=r.scheduler)
    assert _step(resumed, 2) == want
