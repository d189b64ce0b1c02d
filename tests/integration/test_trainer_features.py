"""Algorithm switches through :class:`learner.trainer.Trainer` itself, not only through the pure losses.

One gloo rank in this process, the model loaded and sharded the way the learner does it
(``load_model`` + ``parallelize``), fixed groups whose behaviour log-probs are the initial model's
plus a little noise (so importance weights sit near 1 and differ per level). Each test compares a
trainer metric or gradient with a reference computed here from a plain forward pass, so it fails when
the switch is ignored or mapped wrongly: gradient checkpointing (same gradients, and really on),
``ppo_epochs``, ``recompute_logprobs``, ``dr_grpo``, the importance-weight levels and modes, and the
sampling temperature recorded per trajectory.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from learner.parallelize import load_model, parallelize
from learner.synthetic import make_groups
from learner.trainer import Trainer
from tether.config import TetherConfig
from tether.redis_server import free_port
from tether.trajectory import TEMPERATURE_KEY

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def gloo():
    if dist.is_initialized():  # another module's group: reuse it
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cfg(model_dir: Path, *, learner: dict | None = None, algorithm: dict | None = None) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 16},
            "learner": {"train_batch_size": 4, "lr": 1e-3, "max_token_len_per_gpu": 64, **(learner or {})},
            "algorithm": {"tis_imp_ratio_cap": 1.1, **(algorithm or {})},
        }
    )


def _trainer(cfg: TetherConfig) -> Trainer:
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, CPU), cfg, CPU)
    return Trainer(cfg, model, device=CPU, ref_model=None)


@torch.no_grad()
def _logprobs(model: torch.nn.Module, t, temperature: float = 1.0) -> torch.Tensor:
    """The reference: one sequence alone, logits / T, log-softmax, the sampled tokens' entries (float64)."""
    ids = torch.from_numpy(np.concatenate([t.prompt_token_ids, t.completion_token_ids]).astype(np.int64))[None]
    p = t.prompt_token_ids.shape[0]
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, p - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, p:, None])[:, 0]


def _groups(model_dir: Path, *, temperature: float = 1.0, noise: float = 0.05, seed: int = 0):
    """4 groups of 4; behaviour = the initial model's log-probs at ``temperature`` + N(0, noise)."""
    cfg = _cfg(model_dir)
    plain = load_model(cfg, CPU)
    groups = make_groups(4, 4, vocab=256, seed=seed, prompt_len=(3, 6), completion_len=(3, 10))
    rng = np.random.default_rng(seed + 100)
    for g in groups:
        for t in g.trajectories:
            lp = _logprobs(plain, t, temperature).numpy()
            t.behavior_logprobs = (lp + rng.normal(0, noise, lp.shape)).astype(np.float32)
            if temperature != 1.0:
                t.logprob_source, t.metadata = "processed", {TEMPERATURE_KEY: repr(temperature)}
    return groups, plain


def _token_mean(values: list[torch.Tensor], groups) -> float:
    masks = [torch.from_numpy(t.loss_mask.astype(np.float64)) for g in groups for t in g.trajectories]
    return float(sum((v * m).sum() for v, m in zip(values, masks, strict=True)) / sum(m.sum() for m in masks))


def _grads(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """The gradients each optimizer update applies, captured just before ``step``."""
    out: list[dict[str, torch.Tensor]] = []

    def hook(opt, args, kwargs) -> None:
        out.append({
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in trainer.model.named_parameters() if p.grad is not None
        })  # fmt: skip

    trainer.optimizer.register_step_pre_hook(hook)
    return out


def test_gradient_checkpointing_gives_the_same_gradients_and_is_really_on(tiny_model_dir: Path) -> None:
    groups, _ = _groups(tiny_model_dir)
    grads, block_runs = {}, {}
    for on in (False, True):
        learner = {"enable_gradient_checkpointing": on, "max_token_len_per_gpu": 4096}  # one micro-batch
        trainer = _trainer(_cfg(tiny_model_dir, learner=learner))
        captured = _grads(trainer)
        runs: list[int] = []
        layers = trainer.model.model.layers
        for block in layers:
            block.register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        trainer.train_step(groups, version=0)
        grads[on], block_runs[on] = captured[0], len(runs)
    # With checkpointing every block runs once more, in backward (one micro-batch here).
    assert block_runs[True] - block_runs[False] == len(layers), block_runs
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 10
    for name, g in grads[False].items():
        assert_close(grads[True][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_ppo_epochs_update_twice_and_the_second_epoch_sees_the_moved_policy(tiny_model_dir: Path) -> None:
    groups, plain = _groups(tiny_model_dir)
    trajs = [t for g in groups for t in g.trajectories]
    proximal = [_logprobs(plain, t) for t in trajs]
    trainer = _trainer(_cfg(tiny_model_dir, learner={"ppo_epochs": 2, "lr": 1e-2}))
    after_first: list[torch.Tensor] = []

    def post(opt, args, kwargs) -> None:
        if not after_first:
            after_first.extend(_logprobs(trainer.model, t) for t in trajs)

    trainer.optimizer.register_step_post_hook(post)
    out = trainer.train_step(groups, version=0)
    assert trainer.scheduler.last_epoch == 2  # two optimizer updates: one per epoch
    # Epoch 1 has ratio 1 (ppo_kl 0); epoch 2 measures the policy after the first update against the
    # proximal one. The step's metric is the mean of the two updates.
    kl2 = _token_mean([p - a for p, a in zip(proximal, after_first, strict=True)], groups)
    assert abs(kl2) > 1e-4
    assert out["actor/ppo_kl"] == pytest.approx(kl2 / 2, rel=1e-3, abs=1e-6)
    one = _trainer(_cfg(tiny_model_dir, learner={"ppo_epochs": 1, "lr": 1e-2})).train_step(groups, version=0)
    assert abs(one["actor/ppo_kl"]) < 1e-6 and one["actor/clipfrac"] == 0.0


@pytest.mark.parametrize("recompute", [True, False])
def test_recompute_logprobs_false_uses_behaviour_as_proximal(tiny_model_dir: Path, recompute: bool) -> None:
    groups, plain = _groups(tiny_model_dir)
    trajs = [t for g in groups for t in g.trajectories]
    current = [_logprobs(plain, t) for t in trajs]
    behaviour = [torch.from_numpy(t.behavior_logprobs.astype(np.float64)) for t in trajs]
    out = _trainer(_cfg(tiny_model_dir, algorithm={"recompute_logprobs": recompute})).train_step(groups, version=0)
    cap = 1.1
    if recompute:  # proximal = the current weights: ratio 1, weights proximal / behaviour
        assert abs(out["actor/ppo_kl"]) < 1e-6
        iw = _token_mean([torch.exp(c - b).clamp(max=cap) for c, b in zip(current, behaviour, strict=True)], groups)
        assert out["actor/iw_mean"] == pytest.approx(iw, rel=1e-4)
    else:  # proximal = behaviour: the ratio carries the whole gap, the weights are exactly 1
        kl = _token_mean([b - c for c, b in zip(current, behaviour, strict=True)], groups)
        assert abs(kl) > 1e-4 and out["actor/ppo_kl"] == pytest.approx(kl, rel=1e-3, abs=1e-6)
        assert out["actor/iw_mean"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_dr_grpo_uses_its_aggregation_and_no_std_normalisation(tiny_model_dir: Path, masked: bool) -> None:
    """``masked``: one trajectory is all environment tokens. As in verl it stays in its group's baseline and
    in the sequence count of the aggregation (verl's ``global_batch_size``), and adds no token to the loss."""
    groups, plain = _groups(tiny_model_dir)
    if masked:
        groups[1].trajectories[2].loss_mask = np.zeros_like(groups[1].trajectories[2].loss_mask)
    cfg = _cfg(tiny_model_dir, algorithm={"adv_estimator": "dr_grpo"})
    assert not cfg.algorithm.norm_adv_by_std_in_grpo
    out = _trainer(cfg).train_step(groups, version=0)
    # Ratio 1 on the first update, so the per-token loss is -A·w; Dr.GRPO: A = r - mean(r) (no std),
    # summed over tokens and divided by (sequences · rollout.max_tokens).
    total, n_seq = 0.0, 0
    for g in groups:
        rewards = g.rewards()
        for t, a in zip(g.trajectories, rewards - rewards.mean(), strict=True):
            w = torch.exp(_logprobs(plain, t) - torch.from_numpy(t.behavior_logprobs.astype(np.float64))).clamp(max=1.1)
            total += float((-a * w * torch.from_numpy(t.loss_mask.astype(np.float64))).sum())
            n_seq += 1
    assert out["loss/pg"] == pytest.approx(total / (n_seq * cfg.rollout.max_tokens), rel=1e-4, abs=1e-7)
    assert out.get("learner/fully_masked", 0) == masked


@pytest.mark.parametrize(("level", "mode"), [("token", "truncate"), ("sequence", "mask"), ("sequence", "truncate"),
                                             ("geometric", "mask")])  # fmt: skip
def test_importance_weight_levels_and_modes_through_the_trainer(tiny_model_dir: Path, level: str, mode: str) -> None:
    groups, plain = _groups(tiny_model_dir, noise=0.08)
    cap = 1.02  # low enough that some sequences' geometric means pass it too
    weights, capped = [], []
    for g in groups:
        for t in g.trajectories:
            m = torch.from_numpy(t.loss_mask.astype(np.float64))
            log_w = (_logprobs(plain, t) - torch.from_numpy(t.behavior_logprobs.astype(np.float64))) * m
            if level == "sequence":
                log_w = log_w.sum().expand_as(log_w)  # verl: the product of the token ratios
            elif level == "geometric":
                log_w = (log_w.sum() / m.sum()).expand_as(log_w)
            w = torch.exp(log_w)
            capped.append((w > cap).double())
            weights.append(w.clamp(max=cap) if mode == "truncate" else torch.where(w > cap, 0.0, w))
    algorithm = {"tis_level": level, "tis_mode": mode, "tis_imp_ratio_cap": cap}
    out = _trainer(_cfg(tiny_model_dir, algorithm=algorithm)).train_step(groups, version=0)
    assert out["actor/iw_mean"] == pytest.approx(_token_mean(weights, groups), rel=1e-4)
    frac = _token_mean(capped, groups)
    assert 0.0 < frac < 1.0  # the inputs really exercise the cap
    assert out["actor/iw_capped_frac"] == pytest.approx(frac, rel=1e-4)


def test_the_recorded_temperature_makes_the_weight_one_at_lag_zero(tiny_model_dir: Path) -> None:
    groups, _ = _groups(tiny_model_dir, temperature=0.7, noise=0.0)
    out = _trainer(_cfg(tiny_model_dir)).train_step(groups, version=0)
    assert out["actor/iw_mean"] == pytest.approx(1.0, abs=1e-5) and out["actor/iw_capped_frac"] == 0.0
    # The same data scored at T = 1 (what the learner did before): far from 1.
    for g in groups:
        for t in g.trajectories:
            t.metadata = {}
    raw = _trainer(_cfg(tiny_model_dir)).train_step(groups, version=0)
    assert not math.isclose(raw["actor/iw_mean"], 1.0, abs_tol=1e-2)
