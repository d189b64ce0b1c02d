"""tether's ``policy_loss`` (``learner/losses.py``) against verl 0.9.1's actor loss, called.

verl's side is ``verl.workers.utils.losses.ppo_loss``: the function verl's engine actor calls per
micro-batch, which runs ``core_algos``' vanilla policy loss (``compute_policy_loss_vanilla``: asymmetric and
dual clip) on the rollout-correction weights, then adds the entropy and KL terms through ``agg_loss``, with
the mini-batch's denominators (``batch_num_tokens``, ``global_batch_size`` = every sample, as verl's trainer
passes them). Its inputs go in as verl's engine holds them: a TensorDict with prompts, right-padded
responses, an attention mask covering each response's ``L_i`` tokens, the response mask with its holes, and
the model's log-probs (and entropies) unpadded, one per token of prompt and response.

The importance weights come from verl's ``rollout_corr_helper.compute_rollout_correction_weights`` on
log(proximal / behaviour): tether ``tis_level`` token/sequence with ``tis_mode: truncate`` against verl's
``rollout_is`` token/sequence with a float threshold (TIS), and ``tis_mode: mask`` against verl's IcePop
threshold ``"1e-12_<cap>"`` (a lower bound below exp(-20), the smallest weight either side's clamp leaves,
so only the upper bound acts, as in tether). Every ``LOSS_AGG_MODES`` mode, float32 and float64: the loss,
``loss/pg``, ``actor/clipfrac``, ``actor/ppo_kl``, ``actor/clipfrac_dual`` (verl ``pg_clipfrac_lower``), and
the gradient w.r.t. the log-probs (and the entropies), which is what trains. Log-ratios are N(0, 0.3) with
a wide tail, so both PPO clips and the dual clip (ratio > 3 at a negative advantage) are hit.

No reference: ``tis_level: geometric`` (verl has no geometric-mean rollout weight); ``actor/iw_*`` metrics
(verl's rollout-correction metrics are computed elsewhere, on other keys).
"""

from __future__ import annotations

import types

import pytest
import torch
from tensordict import TensorDict

from learner.losses import LOSS_AGG_MODES, PolicyLossInputs, policy_loss
from tests.reference.inputs import NORM_LEN, Batch, agg_scale, check, make_batch, pack, per_token, seq_ids
from tether.config.algorithm import AlgorithmConfig

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]
CAP = 1.5
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
PROMPT = 2  # prompt tokens per sample in verl's TensorDict (verl requires at least one)
IS_CASES = [
    pytest.param(None, id="is-off"),
    pytest.param(("token", "truncate"), id="is-token-truncate"),
    pytest.param(("sequence", "truncate"), id="is-sequence-truncate"),
    pytest.param(("token", "mask"), id="is-token-mask"),
    pytest.param(("sequence", "mask"), id="is-sequence-mask"),
]


def _log_ratios(batch: Batch, seed: int) -> torch.Tensor:
    """N(0, 0.3), every 7th token N(0, 1.5): ratios in both clip regions and past the dual clip."""
    wide = (torch.arange(batch.mask.numel()) % 7 == 0).reshape(batch.mask.shape)
    return per_token(batch, seed) * torch.where(wide, 5.0, 1.0).to(batch.mask.dtype)


def _unpadded(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """verl's no-padding model output: per sample, its prompt then response positions; position ``p`` holds
    the prediction of token ``p + 1``, so a response's values sit one position before its tokens."""
    rows = [torch.cat([x.new_zeros(PROMPT - 1), x[row, :n], x.new_zeros(1)]) for row, n in enumerate(lengths.tolist())]
    return torch.cat(rows)


def verl_ppo_loss(verl: types.SimpleNamespace, config: object, batch: Batch, model_output: dict, **fields):
    """verl's engine actor loss on one micro-batch holding the whole ``batch``: (loss, {metric: float})."""
    s, t = batch.mask.shape
    response_attention = (torch.arange(t)[None, :] < batch.lengths[:, None]).long()
    data = TensorDict(
        {
            "prompts": torch.ones(s, PROMPT, dtype=torch.long),
            "responses": torch.ones(s, t, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(s, PROMPT, dtype=torch.long), response_attention], dim=1),
            "response_mask": batch.mask,
            **fields,
        },
        batch_size=[s],
    )
    verl.tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=batch.tokens, global_batch_size=s)
    output = {name: _unpadded(x, batch.lengths) for name, x in model_output.items()}
    loss, metrics = verl.losses.ppo_loss(config, output, data)
    return loss, {k: float(m.aggregate()) if hasattr(m, "aggregate") else float(m) for k, m in metrics.items()}


def actor_config(verl: types.SimpleNamespace, mode: str, **knobs: object) -> object:
    return verl.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        use_dynamic_bsz=True,
        clip_ratio=CLIP["clip_ratio_low"],
        loss_agg_mode=mode,
        loss_scale_factor=NORM_LEN,
        **CLIP,
        **knobs,
    )


def tether_policy_loss(batch: Batch, settings: AlgorithmConfig, **per_token_inputs: torch.Tensor | None):
    """tether's policy_loss on the packed batch; ``per_token_inputs`` are [S, T] (or None)."""
    packed = {k: None if v is None else pack(v, batch.lengths) for k, v in per_token_inputs.items()}
    inputs = PolicyLossInputs(
        **packed,
        mask=pack(batch.mask, batch.lengths),
        seq_ids=seq_ids(batch.lengths),
        global_tokens=batch.tokens,
        global_seqs=float(len(batch.lengths)),
        norm_len=NORM_LEN,
    )
    return policy_loss(inputs, settings)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("importance", IS_CASES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_verl(
    verl: types.SimpleNamespace, mode: str, importance: tuple[str, str] | None, dtype: torch.dtype
) -> None:
    batch = make_batch(4, dtype=dtype)
    logprobs = per_token(batch, 40, scale=1.0, shift=-2.0).requires_grad_(True)
    proximal = logprobs.detach() - _log_ratios(batch, 41)
    behavior = proximal - (_log_ratios(batch, 42) if importance else 0.0)
    advantages = per_token(batch, 43)

    fields = {"old_log_probs": proximal, "advantages": advantages}
    if importance:
        level, how = importance
        weights, _ = verl.rollout_corr.compute_rollout_correction_weights(
            log_ratio=proximal - behavior,
            response_mask=batch.mask,
            rollout_is=level,
            rollout_is_threshold=CAP if how == "truncate" else f"1e-12_{CAP}",
        )
        fields["rollout_is_weights"] = weights
    want, want_m = verl_ppo_loss(verl, actor_config(verl, mode), batch, {"log_probs": logprobs}, **fields)
    (want_grad,) = torch.autograd.grad(want, logprobs)

    level, how = importance or ("token", "truncate")
    settings = AlgorithmConfig(loss_agg_mode=mode, tis_imp_ratio_cap=CAP, tis_level=level, tis_mode=how, **CLIP)
    got, got_m = tether_policy_loss(
        batch,
        settings,
        logprobs=logprobs,
        proximal_logprobs=proximal,
        behavior_logprobs=behavior,
        advantages=advantages,
    )
    (got_grad,) = torch.autograd.grad(got, logprobs)

    reference, scale = f"verl {verl.version} ppo_loss", agg_scale(mode, dtype)
    check(got, want, what=f"policy loss {mode}", reference=reference, dtype=dtype, scale=scale)
    check(got_m["loss/pg"], want_m["actor/pg_loss"], what="loss/pg", reference=reference, dtype=dtype, scale=scale)
    check(got_m["actor/ppo_kl"], want_m["actor/ppo_kl"], what="actor/ppo_kl", reference=reference, dtype=dtype)
    # verl counts clipped tokens as ``.float()`` over a bool mask: its fractions are float32 in a float64 batch.
    for ours, theirs in (("actor/clipfrac", "actor/pg_clipfrac"), ("actor/clipfrac_dual", "actor/pg_clipfrac_lower")):
        what = f"{ours} (verl {theirs})"
        check(got_m[ours], want_m[theirs], what=what, reference=reference, dtype=torch.float32)
    check(got_grad, want_grad, what=f"policy loss {mode} d/dlogprobs", reference=reference, dtype=dtype, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "verl_kind"), [("k1", "k1"), ("k3", "low_var_kl")], ids=["k1", "k3"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_and_entropy_terms_match_verl(
    verl: types.SimpleNamespace, mode: str, kind: str, verl_kind: str, dtype: torch.dtype
) -> None:
    """``use_kl_loss`` and ``entropy_coeff``: total = pg + coef * agg(kl) - coeff * agg(entropy), as verl."""
    batch = make_batch(5, dtype=dtype)
    logprobs = per_token(batch, 50, shift=-2.0).requires_grad_(True)
    entropy = per_token(batch, 51, scale=0.5, shift=2.0).abs().requires_grad_(True)
    proximal = logprobs.detach() - _log_ratios(batch, 52)
    ref = logprobs.detach() + per_token(batch, 53, scale=0.5)
    advantages = per_token(batch, 54)
    knobs = {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coeff": 0.01}

    config = actor_config(verl, mode, kl_loss_type=verl_kind, **knobs)
    fields = {"old_log_probs": proximal, "advantages": advantages, "ref_log_prob": ref}
    want, want_m = verl_ppo_loss(verl, config, batch, {"log_probs": logprobs, "entropy": entropy}, **fields)
    want_grads = torch.autograd.grad(want, (logprobs, entropy))

    settings = AlgorithmConfig(loss_agg_mode=mode, kl_loss_type=kind, **knobs, **CLIP)
    got, got_m = tether_policy_loss(
        batch,
        settings,
        logprobs=logprobs,
        proximal_logprobs=proximal,
        behavior_logprobs=proximal,
        advantages=advantages,
        entropy=entropy,
        ref_logprobs=ref,
    )
    got_grads = torch.autograd.grad(got, (logprobs, entropy))

    reference, scale = f"verl {verl.version} ppo_loss", agg_scale(mode, dtype)
    check(got, want, what=f"total loss {mode}", reference=reference, dtype=dtype, scale=scale)
    check(got_m["loss/kl"], want_m["kl_loss"], what=f"loss/kl {kind}", reference=reference, dtype=dtype, scale=scale)
    check(
        got_m["loss/entropy"],
        want_m["actor/entropy_loss"],
        what="loss/entropy",
        reference=reference,
        dtype=dtype,
        scale=scale,
    )
    for name, g, w in zip(("logprobs", "entropy"), got_grads, want_grads, strict=True):
        check(g, w, what=f"total loss {mode} d/d{name}", reference=reference, dtype=dtype, scale=scale)
