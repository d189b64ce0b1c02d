"""The advantage estimators and the value loss against references written here from verl's ``core_algos``
formulas (plain Python loops), on random inputs with masked holes and groups of one."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from learner.advantages import (
    ESTIMATORS,
    AdvantageBatch,
    advantage_batch,
    assign_advantages,
    get_estimator,
    group_advantages,
)
from learner.batch import build_samples
from learner.losses import value_loss
from learner.synthetic import make_groups
from tether.config import AlgorithmConfig


def _batch(seed: int, *, dense: bool) -> AdvantageBatch:
    """Random [S, T]: ragged lengths, masked holes, groups of 1..4; rewards dense or on the last trained token."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 4) for _ in range(5)]
    group_ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    s, t = len(group_ids), 9
    mask = torch.zeros(s, t, dtype=torch.float64)
    rewards = torch.zeros(s, t, dtype=torch.float64)
    for i in range(s):
        n = rng.randint(2, t)
        for j in range(n):
            mask[i, j] = float(j == 0 or rng.random() > 0.25)
        last = max(j for j in range(n) if mask[i, j])
        if dense:
            for j in range(n):
                rewards[i, j] = rng.uniform(-1, 1)
        else:
            rewards[i, last] = rng.uniform(-1, 2)
    values = torch.tensor([[rng.uniform(-1, 1) for _ in range(t)] for _ in range(s)], dtype=torch.float64)
    return AdvantageBatch(token_rewards=rewards, mask=mask, group_ids=torch.tensor(group_ids), values=values)


def _rows(x: torch.Tensor) -> list[list[float]]:
    return x.tolist()


def _ref_whiten(x: list[list[float]], m: list[list[float]]) -> list[list[float]]:
    """verl_F.masked_whiten: (x - mean) * rsqrt(var + 1e-8), unbiased masked variance."""
    n = sum(sum(r) for r in m)
    mean = sum(a * b for xr, mr in zip(x, m, strict=True) for a, b in zip(xr, mr, strict=True)) / (n + 1e-8)
    var = sum((a - mean) ** 2 * b for xr, mr in zip(x, m, strict=True) for a, b in zip(xr, mr, strict=True))
    var = var / (n + 1e-8) * n / (n - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in xr] for xr in x]


def _ref_gae(b: AdvantageBatch, gamma: float, lam: float):
    r, v, m = _rows(b.token_rewards), _rows(b.values), _rows(b.mask)
    adv = []
    for ri, vi, mi in zip(r, v, m, strict=True):
        nextvalues, lastgaelam, row = 0.0, 0.0, []
        for t in reversed(range(len(ri))):
            delta = ri[t] + gamma * nextvalues - vi[t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = vi[t] * mi[t] + (1 - mi[t]) * nextvalues
            lastgaelam = lastgaelam_ * mi[t] + (1 - mi[t]) * lastgaelam
            row.append(lastgaelam)
        adv.append(row[::-1])
    returns = [[a + x for a, x in zip(ar, vr, strict=True)] for ar, vr in zip(adv, v, strict=True)]
    return _ref_whiten(adv, m), returns


def _ref_rloo(b: AdvantageBatch):
    scores = [sum(r) for r in _rows(b.token_rewards)]
    idx = b.group_ids.tolist()
    by = defaultdict(list)
    for i, s in zip(idx, scores, strict=True):
        by[i].append(s)
    out = []
    for i, s, m in zip(idx, scores, _rows(b.mask), strict=True):
        n = len(by[i])
        if n > 1:
            mean = sum(by[i]) / n
            s = s * n / (n - 1) - mean * n / (n - 1)
        out.append([s * x for x in m])
    return out


def _ref_rfpp(b: AdvantageBatch, gamma: float):
    m = _rows(b.mask)
    returns = []
    for ri, mi in zip(_rows(b.token_rewards), m, strict=True):
        running, row = 0.0, [0.0] * len(ri)
        for t in reversed(range(len(ri))):
            running = ri[t] + gamma * running
            row[t] = running
            running = running * mi[t]
        returns.append(row)
    adv = _ref_whiten(returns, m)
    return [[a * x for a, x in zip(ar, mr, strict=True)] for ar, mr in zip(adv, m, strict=True)], returns


def _ref_rfpp_baseline(b: AdvantageBatch):
    scores = [sum(r) for r in _rows(b.token_rewards)]
    idx = b.group_ids.tolist()
    by = defaultdict(list)
    for i, s in zip(idx, scores, strict=True):
        by[i].append(s)
    mean = {i: (sum(v) / len(v) if len(v) > 1 else 0.0) for i, v in by.items()}
    m = _rows(b.mask)
    tiled = [[(s - mean[i]) * x for x in mr] for i, s, mr in zip(idx, scores, m, strict=True)]
    w = _ref_whiten(tiled, m)
    return [[a * x for a, x in zip(ar, mr, strict=True)] for ar, mr in zip(w, m, strict=True)]


def _close(got: torch.Tensor, want: list[list[float]], mask: torch.Tensor | None = None) -> None:
    want_t = torch.tensor(want, dtype=torch.float64)
    if mask is not None:  # entries outside the mask are never trained on
        got, want_t = got * mask, want_t * mask
    assert_close(got, want_t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_gae_matches_verl(seed: int, gamma: float, lam: float) -> None:
    b = _batch(seed, dense=True)
    adv, ret = get_estimator("gae").fn(b, AlgorithmConfig(adv_estimator="gae", gamma=gamma, lam=lam))
    want_adv, want_ret = _ref_gae(b, gamma, lam)
    _close(adv, want_adv)
    _close(ret, want_ret)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_matches_verl(seed: int) -> None:
    b = _batch(seed, dense=False)
    adv, _ = get_estimator("rloo").fn(b, AlgorithmConfig(adv_estimator="rloo"))
    _close(adv, _ref_rloo(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_plus_plus_matches_verl(seed: int, gamma: float) -> None:
    b = _batch(seed, dense=True)
    adv, ret = get_estimator("reinforce_plus_plus").fn(b, AlgorithmConfig(gamma=gamma))
    want_adv, want_ret = _ref_rfpp(b, gamma)
    _close(adv, want_adv)
    _close(ret, want_ret, b.mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_baseline_matches_verl(seed: int) -> None:
    b = _batch(seed, dense=False)
    adv, _ = get_estimator("reinforce_plus_plus_baseline").fn(b, AlgorithmConfig())
    _close(adv, _ref_rfpp_baseline(b))


def test_every_configurable_estimator_is_registered() -> None:
    names = set(AlgorithmConfig.model_fields["adv_estimator"].annotation.__args__)
    assert names == set(ESTIMATORS)
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["gae"]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_verl(mode: str) -> None:
    rng = random.Random(7)
    seqs = [rng.randint(1, 6) for _ in range(6)]
    n = sum(seqs)
    seq_ids = torch.tensor([k for k, m in enumerate(seqs) for _ in range(m)])
    vpreds = torch.tensor([rng.uniform(-2, 2) for _ in range(n)], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([rng.uniform(-2, 2) for _ in range(n)], dtype=torch.float64)
    returns = torch.tensor([rng.uniform(-2, 2) for _ in range(n)], dtype=torch.float64)
    mask = torch.tensor([float(rng.random() > 0.2) for _ in range(n)], dtype=torch.float64)
    mask[torch.tensor([sum(seqs[:k]) for k in range(len(seqs))])] = 1.0
    c = 0.3
    loss, m = value_loss(
        vpreds=vpreds, values=values, returns=returns, mask=mask, seq_ids=seq_ids, global_tokens=float(mask.sum()),
        global_seqs=float(len(seqs)), cliprange_value=c, loss_agg_mode=mode,
    )  # fmt: skip
    per_tok, clipped = [], []
    for v, old, r in zip(vpreds.tolist(), values.tolist(), returns.tolist(), strict=True):
        vc = min(max(v, old - c), old + c)
        per_tok.append(max((v - r) ** 2, (vc - r) ** 2))
        clipped.append(float((vc - r) ** 2 > (v - r) ** 2))
    mk = mask.tolist()
    if mode == "token-mean":
        want = 0.5 * sum(x * w for x, w in zip(per_tok, mk, strict=True)) / sum(mk)
    else:
        per_seq, at = [], 0
        for ln in seqs:
            w = mk[at : at + ln]
            per_seq.append(sum(x * y for x, y in zip(per_tok[at : at + ln], w, strict=True)) / sum(w))
            at += ln
        want = 0.5 * sum(per_seq) / len(seqs)
    assert_close(loss, torch.tensor(want, dtype=torch.float64))
    frac = sum(x * w for x, w in zip(clipped, mk, strict=True)) / sum(mk)
    assert 0 < frac < 1  # the clip really acts on these inputs
    assert_close(m["critic/vf_clipfrac"], torch.tensor(frac, dtype=torch.float64))
    loss.backward()
    assert (vpreds.grad[mask == 0] == 0).all() and vpreds.grad.abs().sum() > 0


def test_samples_get_the_reward_on_their_last_trained_token_and_grpo_keeps_its_numbers() -> None:
    groups = make_groups(3, 4, vocab=64, seed=5, completion_len=(5, 9))
    groups[0].trajectories[0].loss_mask[-1] = 0  # an environment token at the end
    samples, _ = build_samples(groups, current_version=0, norm_by_std=True)
    before = [float(s.advantage) for s in samples]
    b = advantage_batch(samples, with_values=False)
    first = samples[0]
    assert b.token_rewards[0, first.num_completion - 2] == first.reward and b.token_rewards[0].sum() == first.reward
    assign_advantages(samples, AlgorithmConfig())
    for s, a in zip(samples, before, strict=True):
        assert s.advantage.shape == (s.num_completion,)
        assert np.allclose(s.advantage, a, atol=1e-6)  # the registry's grpo is build_samples' grpo


@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_matches_trl_group_scaling(seed: int) -> None:
    """TRL's GRPOTrainer (``scale_rewards="group"``): (r - group mean) / (unbiased group std + 1e-4), the
    generations of a prompt contiguous. tether's estimator on shuffled samples gives the same numbers with
    TRL's eps, and within 1e-3 relative with its own (1e-6) where the group's std is not tiny — so the
    advantage formula is not where a tether run and a TRL run of the same job part (docs/STALENESS.md)."""
    g = torch.Generator().manual_seed(seed)
    prompts, n = 8, 8
    rewards = torch.randint(0, 65, (prompts, n), generator=g).double() / 64  # charclass: a fraction of 64 chars
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)  # torch.std: unbiased, as TRL's nanstd
    trl = ((rewards - mean) / (std + 1e-4)).flatten().float()
    order = torch.randperm(prompts * n, generator=g)
    gids = torch.arange(prompts).repeat_interleave(n)[order]
    got = torch.empty_like(trl)
    got[order] = group_advantages(rewards.flatten()[order], gids, norm_by_std=True, eps=1e-4)
    assert_close(got, trl)
    got[order] = group_advantages(rewards.flatten()[order], gids, norm_by_std=True)
    assert_close(got, trl, rtol=1e-3, atol=0)
