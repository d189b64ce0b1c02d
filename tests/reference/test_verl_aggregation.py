"""tether's loss aggregation, value loss and KL estimators (``learner/losses.py``) against verl 0.9.1's own.

- ``aggregate`` on the packed layout vs ``core_algos.agg_loss`` on the padded one, every ``LOSS_AGG_MODES``
  mode, on the batches of :mod:`tests.reference.inputs` (holes, fully-masked samples). Two denominators,
  both verl's: its local one (``agg_loss`` without batch info: fully-masked samples are not counted in a
  seq-mean, so tether gets ``global_seqs`` = samples with a trained token) and its engine's global one
  (``batch_num_tokens``/``global_batch_size`` given, as verl's workers pass them: every sample of the
  mini-batch counts), split into two micro-batches whose shares must each match and sum to the whole.
- ``value_loss`` vs ``core_algos.compute_value_loss``, every mode (``norm_len`` = ``loss_scale_factor``):
  the loss, ``critic/vf_clipfrac`` and the gradient w.r.t. the predicted values.
- ``kl_penalty`` k1/k3 vs ``core_algos.kl_penalty`` "k1"/"kl" and "k3"/"low_var_kl", values and gradients,
  with log-ratios wide enough to reach verl's clamps (±20 on the log-ratio, ±10 on k3).

float32 and float64. No reference here: the metrics' ``_max`` keys (verl reports none).
"""

from __future__ import annotations

import types

import pytest
import torch

from learner.losses import LOSS_AGG_MODES, aggregate, kl_penalty, value_loss
from tests.reference.inputs import NORM_LEN, agg_scale, check, make_batch, pack, per_token, seq_ids

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]
SEEDS = (0, 1)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_matches_verl_agg_loss(verl: types.SimpleNamespace, mode: str, dtype: torch.dtype, seed: int) -> None:
    batch = make_batch(seed, dtype=dtype)
    values = per_token(batch, seed + 10, scale=2.0)
    want = verl.core_algos.agg_loss(
        loss_mat=values, loss_mask=batch.mask, loss_agg_mode=mode, loss_scale_factor=NORM_LEN
    )
    got = aggregate(
        pack(values, batch.lengths),
        pack(batch.mask, batch.lengths),
        seq_ids(batch.lengths),
        mode=mode,
        global_tokens=batch.tokens,
        global_seqs=batch.trained_seqs,
        norm_len=NORM_LEN,
    )
    reference = f"verl {verl.version} agg_loss"
    check(got, want, what=f"aggregate {mode}", reference=reference, dtype=dtype, scale=agg_scale(mode, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_shares_match_verl_global_batch(verl: types.SimpleNamespace, mode: str, dtype: torch.dtype) -> None:
    """Two micro-batches with the mini-batch's denominators (verl's engine path): each share matches."""
    batch = make_batch(3, dtype=dtype)
    values = per_token(batch, 13, scale=2.0)
    n = len(batch.lengths)
    info = {"dp_size": 1, "batch_num_tokens": batch.tokens, "global_batch_size": n, "loss_scale_factor": NORM_LEN}
    scale, reference = agg_scale(mode, dtype), f"verl {verl.version} agg_loss"
    total = 0.0
    for rows in (slice(0, n // 2), slice(n // 2, n)):
        lengths, mask = batch.lengths[rows], batch.mask[rows]
        want = verl.core_algos.agg_loss(loss_mat=values[rows], loss_mask=mask, loss_agg_mode=mode, **info)
        got = aggregate(
            pack(values[rows], lengths),
            pack(mask, lengths),
            seq_ids(lengths),
            mode=mode,
            global_tokens=batch.tokens,
            global_seqs=float(n),
            norm_len=NORM_LEN,
        )
        what = f"aggregate {mode}, rows {rows.start}:{rows.stop}"
        check(got, want, what=what, reference=reference, dtype=dtype, scale=scale)
        total = total + got
    whole = verl.core_algos.agg_loss(loss_mat=values, loss_mask=batch.mask, loss_agg_mode=mode, **info)
    check(total, whole, what=f"aggregate {mode}, sum of shares", reference=reference, dtype=dtype, scale=scale)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_verl(verl: types.SimpleNamespace, mode: str, dtype: torch.dtype, seed: int) -> None:
    batch = make_batch(seed, dtype=dtype)
    values = per_token(batch, seed + 20)
    returns = per_token(batch, seed + 21)
    # New predictions near the old values, some beyond the clip range of 0.2 on either side.
    vpreds = (values + per_token(batch, seed + 22, scale=0.3)).requires_grad_(True)
    cliprange = 0.2
    want, want_clipfrac = verl.core_algos.compute_value_loss(
        vpreds=vpreds,
        returns=returns,
        values=values,
        response_mask=batch.mask,
        cliprange_value=cliprange,
        loss_agg_mode=mode,
        loss_scale_factor=NORM_LEN,
    )
    (want_grad,) = torch.autograd.grad(want, vpreds)
    lengths = batch.lengths
    got, metrics = value_loss(
        vpreds=pack(vpreds, lengths),
        values=pack(values, lengths),
        returns=pack(returns, lengths),
        mask=pack(batch.mask, lengths),
        seq_ids=seq_ids(lengths),
        global_tokens=batch.tokens,
        global_seqs=batch.trained_seqs,
        cliprange_value=cliprange,
        loss_agg_mode=mode,
        norm_len=NORM_LEN,
    )
    (got_grad,) = torch.autograd.grad(got, vpreds)
    reference = f"verl {verl.version} compute_value_loss"
    scale = agg_scale(mode, dtype)
    check(got, want, what=f"value_loss {mode}", reference=reference, dtype=dtype, scale=scale)
    check(metrics["critic/vf_clipfrac"], want_clipfrac, what="critic/vf_clipfrac", reference=reference, dtype=dtype)
    check(got_grad, want_grad, what=f"value_loss {mode} d/dvpreds", reference=reference, dtype=dtype, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("kind", "verl_name"), [("k1", "k1"), ("k1", "kl"), ("k3", "k3"), ("k3", "low_var_kl")], ids=lambda v: v
)
def test_kl_penalty_matches_verl(verl: types.SimpleNamespace, kind: str, verl_name: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    ref = (-3.0 * torch.rand(400, generator=gen, dtype=torch.float64)).to(dtype)
    # Mostly small log-ratios, a tail of large ones, and a few past the ±20 clamp.
    delta = torch.randn(400, generator=gen, dtype=torch.float64) * torch.where(torch.arange(400) % 5 == 0, 8.0, 0.5)
    delta[:4] = torch.tensor([25.0, -25.0, 12.0, -12.0])
    logprobs = (ref + delta.to(dtype)).requires_grad_(True)
    want = verl.core_algos.kl_penalty(logprobs, ref, verl_name)
    got = kl_penalty(logprobs, ref, kind=kind)
    reference = f"verl {verl.version} kl_penalty({verl_name!r})"
    check(got, want, what=f"kl_penalty {kind}", reference=reference, dtype=dtype)
    (want_grad,) = torch.autograd.grad(want.sum(), logprobs)
    (got_grad,) = torch.autograd.grad(got.sum(), logprobs)
    check(got_grad, want_grad, what=f"kl_penalty {kind} d/dlogprobs", reference=reference, dtype=dtype)
