"""A user's advantage estimator, registered with what it needs, end to end: the config accepts its name only
once it is registered and refuses a run without what it needs, and a real trainer step (tiny model, one gloo
rank, CPU) runs the reference pass before it and trains on its advantages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from learner import advantages
from learner.advantages import AdvantageBatch, register_adv_est
from tether.config import AlgorithmConfig, ConfigError, TetherConfig, load_config
from tether.config import adv_estimator as declared


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both registries are module-level: a test's entries leave with it."""
    monkeypatch.setattr(advantages, "ESTIMATORS", dict(advantages.ESTIMATORS))
    monkeypatch.setattr(declared, "ADV_ESTIMATORS", dict(declared.ADV_ESTIMATORS))


def _cfg(model_dir: Path, estimator: str) -> TetherConfig:
    return load_config(
        None,
        ["--model.path", str(model_dir), "--rollout.max_tokens", "24", "--algorithm.adv_estimator", estimator,
         "--learner", "{train_batch_size: 4, lr: 1e-2, lr_warmup_steps: 0, use_dynamic_bsz: false,"
                      " micro_batch_size_per_gpu: 4}"],
    )  # fmt: skip


def test_a_registered_estimator_with_a_reference_runs_through_the_trainer(
    registries, one_rank, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner.parallelize import load_model
    from learner.synthetic import make_groups
    from learner.trainer import Trainer

    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator: unknown estimator 'kl_shaped'"):
        _cfg(model_dir, "kl_shaped")
    seen: list[AdvantageBatch] = []

    # --- the recipe: one function, declaring what it reads.
    @register_adv_est("kl_shaped", needs_reference=True)
    def kl_shaped(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
        """GRPO on the reward minus 0.1 x the sequence's summed log-ratio to the reference (a KL-in-reward)."""
        seen.append(batch)
        shaped = batch.token_rewards.clone()
        last = batch.mask.shape[1] - 1 - batch.mask.flip(1).argmax(1)
        shaped[torch.arange(len(last)), last] -= 0.1 * (batch.ref_logprobs * batch.mask).sum(1)
        return advantages.grpo(AdvantageBatch(shaped, batch.mask, batch.group_ids), cfg)

    cfg = _cfg(model_dir, "kl_shaped")
    assert cfg.algorithm.uses_reference and not cfg.algorithm.use_kl_loss
    torch.manual_seed(0)
    model = load_model(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="'kl_shaped' needs the reference model"):
        Trainer(cfg, model, device=torch.device("cpu"), ref_model=None)
    ref = load_model(cfg, torch.device("cpu")).requires_grad_(False)
    trainer = Trainer(cfg, model, device=torch.device("cpu"), ref_model=ref)
    passes: list[str] = []
    real = trainer._forward_only
    monkeypatch.setattr(trainer, "_forward_only", lambda m, s, p, field: (passes.append(field), real(m, s, p, field)))
    before = [p.detach().clone() for p in model.parameters()]

    out = trainer.train_step(make_groups(4, 4, vocab=256, seed=0), version=1)

    assert passes == ["ref_logprobs"]  # once, before the estimator; the KL loss is off, so nothing else reads it
    (batch,) = seen
    assert batch.ref_logprobs is not None and batch.ref_logprobs.shape == batch.mask.shape
    assert (batch.ref_logprobs[batch.mask.bool()] < 0).all()  # the reference's log-probs of the trained tokens
    assert "loss/kl" not in out and np.isfinite(out["loss/pg"]) and out["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_registered_estimator_needing_a_critic_is_refused_without_one(registries) -> None:
    @register_adv_est("values_only", needs_critic=True)
    def values_only(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
        return batch.values, batch.values

    assert load_config(None, ["--algorithm.adv_estimator", "values_only"]).algorithm.estimator.needs_critic
    with pytest.raises(ConfigError, match=r"values_only needs a critic, and critic\.enable is false .* use an "
                                          r"estimator without one: dr_grpo, grpo"):  # fmt: skip
        load_config(None, ["--algorithm.adv_estimator", "values_only", "--critic.enable", "false"])
    with pytest.raises(ValueError, match="'values_only' is registered twice"):
        register_adv_est("values_only", needs_critic=True)(values_only)
