"""The losses against plain-Python references on random inputs (every advantage, aggregation and IS mode)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.testing import assert_close

from learner.losses import PolicyLossInputs, aggregate, importance_weights, kl_penalty, policy_loss
from tether.config import AlgorithmConfig


def _seqs(seed: int, n_seq: int = 5) -> list[dict[str, list[float]]]:
    """Random sequences: per-token logprob (current, proximal, behaviour, reference), mask, one advantage."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_seq):
        n = rng.randint(1, 7)
        base = [-rng.uniform(0.1, 3.0) for _ in range(n)]
        mask = [float(rng.random() > 0.25) for _ in range(n)]
        mask[0] = 1.0  # every sequence has at least one trained token (fully masked ones are dropped upstream)
        out.append(
            {
                "cur": [b + rng.uniform(-0.6, 0.6) for b in base],
                "prox": [b + rng.uniform(-0.3, 0.3) for b in base],
                "beh": [b + rng.uniform(-1.0, 1.0) for b in base],
                "ref": [b + rng.uniform(-0.5, 0.5) for b in base],
                "ent": [rng.uniform(0.0, 2.0) for _ in range(n)],
                "mask": mask,
                "adv": rng.choice([-1.0, 1.0]) * rng.uniform(0.1, 2.0),
            }
        )
    return out


def _flat(seqs, key):
    if key == "adv":
        return torch.tensor([s["adv"] for s in seqs for _ in s["mask"]], dtype=torch.float64)
    return torch.tensor([v for s in seqs for v in s[key]], dtype=torch.float64)


def _seq_ids(seqs):
    return torch.tensor([k for k, s in enumerate(seqs) for _ in s["mask"]])


# ---------- importance weights


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_importance_weights_match_loop(level: str, mode: str) -> None:
    seqs, cap = _seqs(2, 8), 1.5
    got, _ = importance_weights(
        _flat(seqs, "prox"), _flat(seqs, "beh"), _seq_ids(seqs), _flat(seqs, "mask"), cap=cap, level=level, mode=mode
    )
    want = []
    for s in seqs:
        logs = [(p - b) * m for p, b, m in zip(s["prox"], s["beh"], s["mask"], strict=True)]
        if level == "sequence":  # the product of the token ratios
            logs = [sum(logs)] * len(logs)
        elif level == "geometric":  # their geometric mean
            logs = [sum(logs) / sum(s["mask"])] * len(logs)
        for lw in logs:
            w = math.exp(lw)
            want.append(min(w, cap) if mode == "truncate" else (0.0 if w > cap else w))
    assert_close(got, torch.tensor(want, dtype=torch.float64))


def _verl_rollout_is(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> torch.Tensor:
    """verl's ``compute_rollout_correction_weights`` (trainer/ppo/rollout_corr_helper.py) on padded
    [B, T] tensors, without batch normalisation: token = exp(clamp(r)); sequence = exp(clamp(Σ masked r)),
    broadcast; then zeroed on padding and truncated at the threshold."""
    bound = 20.0  # verl's SAFETY_BOUND
    if level == "token":
        w = torch.exp(log_ratio.clamp(-bound, bound))
    else:
        total = (log_ratio * mask).sum(-1, keepdim=True)
        w = torch.exp(total.clamp(-bound, bound)).expand_as(log_ratio)
    return (w * mask).clamp(max=threshold)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_importance_weights_match_verl(level: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (6,), generator=g).tolist()
    width = max(lengths)
    prox = -torch.rand(6, width, generator=g, dtype=torch.float64) * 3
    beh = prox + (torch.rand(6, width, generator=g, dtype=torch.float64) - 0.5) * 0.4
    mask = (torch.rand(6, width, generator=g) > 0.2).double()
    for i, n in enumerate(lengths):
        mask[i, n:] = 0.0
        mask[i, 0] = 1.0
    want = _verl_rollout_is(prox - beh, mask, level, threshold=1.3)
    flat = [(i, j) for i, n in enumerate(lengths) for j in range(n)]
    pick = lambda t: torch.stack([t[i, j] for i, j in flat])  # noqa: E731 - packed layout, as the learner's
    got, _ = importance_weights(
        pick(prox), pick(beh), torch.tensor([i for i, _ in flat]), pick(mask), cap=1.3, level=level, mode="truncate"
    )
    assert_close(got * pick(mask), pick(want))


# ---------- aggregation


def _ref_agg(seqs, per_tok, mode, norm_len):
    total_tokens = sum(sum(s["mask"]) for s in seqs)
    if mode == "token-mean":
        return sum(v * m for s, vs in zip(seqs, per_tok, strict=True) for v, m in zip(vs, s["mask"], strict=True)) / (
            total_tokens
        )
    per_seq = []
    for s, vs in zip(seqs, per_tok, strict=True):
        tot = sum(v * m for v, m in zip(vs, s["mask"], strict=True))
        if mode == "seq-mean-token-mean":
            per_seq.append(tot / sum(s["mask"]))
        elif mode == "seq-mean-token-sum":
            per_seq.append(tot)
        else:
            per_seq.append(tot / norm_len)
    return sum(per_seq) / len(per_seq)


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_split_in_micro_batches_matches_loop(mode: str) -> None:
    seqs = _seqs(3, 6)
    want = _ref_agg(seqs, [s["cur"] for s in seqs], mode, 16.0)
    g_tok, g_seq = sum(sum(s["mask"]) for s in seqs), len(seqs)
    got = 0.0
    for part in (seqs[:2], seqs[2:]):  # two micro-batches: shares must add up to the whole
        got = got + aggregate(
            _flat(part, "cur"),
            _flat(part, "mask"),
            _seq_ids(part),
            mode=mode,
            global_tokens=g_tok,
            global_seqs=g_seq,
            norm_len=16.0,
        )
    assert_close(got, torch.tensor(want, dtype=torch.float64))


# ---------- the policy loss


def _ref_policy(seqs, st: AlgorithmConfig, norm_len: float):
    per_tok, kl_tok = [], []
    for s in seqs:
        lt, kt = [], []
        if st.tis_level != "token":
            total = sum((p - b) * m for p, b, m in zip(s["prox"], s["beh"], s["mask"], strict=True))
            # sequence: verl's product of token ratios, exp(clamp(sum log r, ±20)); geometric: their mean
            mean = max(-20.0, min(20.0, total)) if st.tis_level == "sequence" else total / sum(s["mask"])
        for cur, prox, beh, ref, m in zip(s["cur"], s["prox"], s["beh"], s["ref"], s["mask"], strict=True):
            a = s["adv"]
            ratio = math.exp(cur - prox)
            pg = max(-a * ratio, -a * min(max(ratio, 1 - st.clip_ratio_low), 1 + st.clip_ratio_high))
            if a < 0:
                pg = min(pg, -a * st.clip_ratio_c)
            w = math.exp(mean if st.tis_level != "token" else (prox - beh) * m)
            w = min(w, st.tis_imp_ratio_cap) if st.tis_mode == "truncate" else (0.0 if w > st.tis_imp_ratio_cap else w)
            lt.append(pg * w)
            if st.kl_loss_type == "k1":
                kt.append(cur - ref)
            else:
                kt.append(math.exp(ref - cur) - (ref - cur) - 1)
        per_tok.append(lt)
        kl_tok.append(kt)
    mode = st.loss_agg_mode
    total = _ref_agg(seqs, per_tok, mode, norm_len)
    if st.use_kl_loss:
        total += st.kl_loss_coef * _ref_agg(seqs, kl_tok, mode, norm_len)
    total -= st.entropy_coeff * _ref_agg(seqs, [s["ent"] for s in seqs], mode, norm_len)
    return total


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "tis",
    [
        ("token", "truncate"),
        ("sequence", "mask"),
        ("sequence", "truncate"),
        ("geometric", "mask"),
        ("geometric", "truncate"),
        ("token", "mask"),
    ],
)
@pytest.mark.parametrize("kl", ["k1", "k3"])
def test_policy_loss_matches_loop(mode: str, tis: tuple[str, str], kl: str) -> None:
    st = AlgorithmConfig(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=1.5,  # small so dual clip actually triggers on random ratios
        loss_agg_mode=mode,
        tis_imp_ratio_cap=1.6,
        tis_level=tis[0],
        tis_mode=tis[1],
        use_kl_loss=True,
        kl_loss_coef=0.3,
        kl_loss_type=kl,
        entropy_coeff=0.05,
    )
    seqs = _seqs(4, 9)
    cur = _flat(seqs, "cur").requires_grad_(True)
    loss, metrics = policy_loss(
        PolicyLossInputs(
            logprobs=cur,
            proximal_logprobs=_flat(seqs, "prox"),
            behavior_logprobs=_flat(seqs, "beh"),
            advantages=_flat(seqs, "adv"),
            mask=_flat(seqs, "mask"),
            seq_ids=_seq_ids(seqs),
            global_tokens=float(sum(sum(s["mask"]) for s in seqs)),
            global_seqs=float(len(seqs)),
            norm_len=8.0,
            entropy=_flat(seqs, "ent"),
            ref_logprobs=_flat(seqs, "ref"),
        ),
        st,
    )
    assert_close(loss, torch.tensor(_ref_policy(seqs, st, 8.0), dtype=torch.float64))
    loss.backward()
    assert torch.isfinite(cur.grad).all()
    assert {"loss/pg", "loss/kl", "loss/entropy", "loss/total", "actor/clipfrac", "actor/iw_mean"} <= set(metrics)
    assert 0.0 <= float(metrics["actor/clipfrac"]) <= 1.0


def test_on_policy_grpo_gradient_is_advantage_weighted_logprob_gradient() -> None:
    """With proximal = behaviour = current (no staleness), the clip is inactive and the gradient of the
    token-mean loss is -A * grad(logp) / tokens: plain policy gradient."""
    seqs = _seqs(5, 4)
    cur = _flat(seqs, "cur").requires_grad_(True)
    mask = torch.ones_like(cur)
    loss, m = policy_loss(
        PolicyLossInputs(
            logprobs=cur,
            proximal_logprobs=cur.detach(),
            behavior_logprobs=cur.detach(),
            advantages=_flat(seqs, "adv"),
            mask=mask,
            seq_ids=_seq_ids(seqs),
            global_tokens=float(cur.numel()),
            global_seqs=4.0,
        ),
        AlgorithmConfig(),
    )
    loss.backward()
    assert_close(cur.grad, -_flat(seqs, "adv") / cur.numel())
    assert float(m["actor/clipfrac"]) == 0.0


def test_kl_k3_is_nonnegative_and_zero_at_equality() -> None:
    a = torch.randn(50, dtype=torch.float64)
    assert (kl_penalty(a, a + torch.randn(50, dtype=torch.float64), kind="k3") >= 0).all()
    assert_close(kl_penalty(a, a, kind="k3"), torch.zeros(50, dtype=torch.float64))


def test_huge_log_ratio_stays_finite() -> None:
    cur = torch.tensor([0.0, -1.0], requires_grad=True)
    loss, _ = policy_loss(
        PolicyLossInputs(
            logprobs=cur,
            proximal_logprobs=torch.tensor([-500.0, -1.0]),
            behavior_logprobs=torch.tensor([-1.0, 400.0]),
            advantages=torch.tensor([1.0, -1.0]),
            mask=torch.tensor([1.0, 0.0]),
            seq_ids=torch.tensor([0, 1]),
            global_tokens=1.0,
            global_seqs=2.0,
        ),
        AlgorithmConfig(),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(cur.grad).all()
