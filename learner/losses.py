"""The policy and value losses as pure functions over flat per-token tensors.

Every function takes the tokens of one micro-batch laid out flat (``[N]``, the packed layout: one entry
per *completion* token, sequences one after another) plus ``seq_ids: [N]`` naming each token's
sequence, and returns ``(loss, metrics)``. Nothing here knows about models, ranks or the buffer.

Normalisation is global: the denominators (trained tokens, sequences) of the whole mini-batch on all
ranks are passed in, so summing the returned losses over micro-batches and ranks gives exactly the
loss of the mini-batch as if it had been one tensor. That is what makes a 2-rank step equal a 1-rank
step, and micro-batching a pure memory lever. Metrics follow the same rule: each value is this
micro-batch's contribution to a mini-batch mean (sum them), except keys ending in ``_max`` (take the
max).

GRPO, Dr.GRPO and DAPO are all :func:`policy_loss` (PPO-clip with asymmetric and dual clip, decoupled
importance weights) with particular settings, not branches of their own. A policy loss is one function
here, registered under its ``algorithm.policy_loss.loss_mode`` (:func:`register_policy_loss`), plus one
config class for its own knobs (:mod:`tether.config.policy_loss`). Every policy loss has one signature,
``(inputs: PolicyLossInputs, settings: AlgorithmConfig) -> (loss, metrics)``: the micro-batch's tensors
in one typed object the trainer builds once, and the ``algorithm`` section itself, so the trainer copies
no fields; a new input is one field of :class:`PolicyLossInputs` and one line where the trainer fills it.
:func:`value_loss` is the critic's (PPO with GAE). The advantages are in :mod:`learner.advantages`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.registry import lookup
from tether.config.algorithm import AlgorithmConfig

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
TIS_LEVELS = ("token", "sequence", "geometric")


def importance_weights(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    seq_ids: Tensor,
    mask: Tensor,
    *,
    cap: float,
    level: str,
    mode: str,
) -> tuple[Tensor, Tensor]:
    """Truncated importance weights proximal / behaviour (decoupled PPO's off-policy correction).

    All inputs [N]; ``mask`` is 1.0 for trained tokens. ``level="token"``: one weight per token;
    ``"sequence"``: verl's sequence-level weight, the product of the sequence's per-token ratios over its
    trained tokens (unbiased, high variance), shared by its tokens; ``"geometric"``: their geometric mean
    (the per-token ratios' mean in log space; biased, low variance), shared by its tokens.
    ``mode="truncate"``: ``min(w, cap)``; ``"mask"``: tokens (or sequences) with ``w > cap`` get weight 0.
    Returns ``(weights [N] detached, capped [N] bool)``.
    """
    log_w = (proximal_logprobs - behavior_logprobs).detach() * mask
    if level in ("sequence", "geometric"):
        n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        tot = torch.zeros(n_seq, dtype=log_w.dtype, device=log_w.device).index_add_(0, seq_ids, log_w)
        if level == "geometric":
            cnt = torch.zeros(n_seq, dtype=log_w.dtype, device=log_w.device).index_add_(0, seq_ids, mask)
            tot = tot / cnt.clamp(min=1)
        log_w = tot[seq_ids]
    elif level != "token":
        raise ValueError(f"tis_level must be one of {TIS_LEVELS}, not {level!r}")
    # Clamp before exp: a wild log-ratio must not become inf (inf * 0 would be NaN under the mask).
    w = torch.exp(log_w.clamp(-20.0, 20.0))
    capped = w > cap
    if mode == "truncate":
        w = w.clamp(max=cap)
    elif mode == "mask":
        w = torch.where(capped, torch.zeros_like(w), w)
    else:
        raise ValueError(f"tis_mode must be 'truncate' or 'mask', not {mode!r}")
    return w, capped


def aggregate(
    values: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    mode: str,
    global_tokens: float,
    global_seqs: float,
    seq_token_counts: Tensor | None = None,
    norm_len: float = 1.0,
) -> Tensor:
    """This micro-batch's share of the mini-batch aggregate of per-token ``values``.

    values, mask, seq_ids: [N]. ``global_tokens``/``global_seqs``: trained tokens and sequences of the
    whole mini-batch (all ranks). ``seq_token_counts``: [S] trained tokens per local sequence (needed by
    ``seq-mean-token-mean``; computed from ``mask`` when omitted — correct as long as a sequence is never
    split across micro-batches, which packing guarantees). ``norm_len``: Dr.GRPO's constant length.
    """
    masked = values * mask
    if mode == "token-mean":
        return masked.sum() / max(global_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(global_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (max(global_seqs, 1.0) * norm_len)
    if mode == "seq-mean-token-mean":
        if seq_token_counts is None:
            n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
            seq_token_counts = torch.zeros(n_seq, dtype=mask.dtype, device=mask.device).index_add_(0, seq_ids, mask)
        per_token = masked / seq_token_counts.clamp(min=1)[seq_ids]
        return per_token.sum() / max(global_seqs, 1.0)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, not {mode!r}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, kind: str) -> Tensor:
    """Per-token KL(policy || reference) estimate, [N] -> [N]. k1: log ratio; k3: exp(-x) + x - 1."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k3":
        # Clamped as in verl: the estimator is exp(ref - logp); a far-off token must not blow it up.
        neg = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_loss_type must be 'k1' or 'k3', not {kind!r}")


@dataclass
class PolicyLossInputs:
    """One micro-batch's inputs of a policy loss: tensors ``[N]``, one entry per completion token."""

    logprobs: Tensor
    """Under the current weights, with grad."""
    proximal_logprobs: Tensor
    """Recomputed before the update (decoupled PPO's proximal policy), or the behaviour ones when not."""
    behavior_logprobs: Tensor
    """The rollout's, from the policy that sampled the tokens."""
    advantages: Tensor
    mask: Tensor
    """1.0 on trained tokens."""
    seq_ids: Tensor
    """Each token's sequence in the micro-batch (long)."""
    global_tokens: float
    """Trained tokens of the whole mini-batch on all ranks (the aggregation's denominator)."""
    global_seqs: float
    """Sequences of the whole mini-batch on all ranks."""
    norm_len: float = 1.0
    """Dr.GRPO's constant length (``rollout.max_tokens``) for ``seq-mean-token-sum-norm``."""
    entropy: Tensor | None = None
    """Per-token entropy of the current policy (with grad when the entropy bonus is on)."""
    ref_logprobs: Tensor | None = None
    """Under the frozen reference model; None when the run loads none."""

    @classmethod
    def empty(cls) -> PolicyLossInputs:
        """No tokens, every optional input present: a loss's call on it names all the metrics it reports."""
        z = torch.zeros(0)
        return cls(logprobs=z, proximal_logprobs=z, behavior_logprobs=z, advantages=z, mask=z,
                   seq_ids=z.long(), global_tokens=1.0, global_seqs=1.0, entropy=z, ref_logprobs=z)  # fmt: skip


def policy_loss(inputs: PolicyLossInputs, settings: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO-clip with asymmetric clip, dual clip, truncated IS, KL and entropy terms.

    ratio = exp(logprobs - proximal); per-token loss = w * max(-A*ratio, -A*clip(ratio, 1-lo, 1+hi)),
    for A < 0 additionally capped at -A*c (dual clip); w = truncated proximal/behaviour weight.
    ``settings``: the ``algorithm`` section itself (clip ratios, IS, KL, entropy, aggregation).
    Returns the scalar loss share and summable metrics (see the module docstring).
    """
    x, s = inputs, settings
    lp, adv, seq_ids = x.logprobs, x.advantages, x.seq_ids
    agg = dict(mode=s.loss_agg_mode, global_tokens=x.global_tokens, global_seqs=x.global_seqs, norm_len=x.norm_len)
    mask = x.mask.to(lp.dtype)
    log_ratio = (lp - x.proximal_logprobs.detach()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -adv * s.clip_ratio_c
    dual = torch.minimum(clipped, pg3)
    pg_tok = torch.where(adv < 0, dual, clipped)
    weights, capped = importance_weights(
        x.proximal_logprobs, x.behavior_logprobs, seq_ids, mask,
        cap=s.tis_imp_ratio_cap, level=s.tis_level, mode=s.tis_mode,
    )  # fmt: skip
    pg_loss = aggregate(pg_tok * weights, mask, seq_ids, **agg)
    total = pg_loss
    tok_mean = dict(mode="token-mean", global_tokens=x.global_tokens, global_seqs=x.global_seqs)
    metrics: dict[str, Tensor] = {
        "loss/pg": pg_loss.detach(),
        "actor/clipfrac": aggregate((pg2 > pg1).float(), mask, seq_ids, **tok_mean),
        "actor/clipfrac_dual": aggregate(((adv < 0) & (pg3 < clipped)).float(), mask, seq_ids, **tok_mean),
        "actor/ppo_kl": aggregate(-log_ratio.detach(), mask, seq_ids, **tok_mean),
        "actor/iw_mean": aggregate(weights, mask, seq_ids, **tok_mean),
        "actor/iw_capped_frac": aggregate(capped.float(), mask, seq_ids, **tok_mean),
        "actor/iw_max": (weights * mask).max() if weights.numel() else weights.new_zeros(()),
    }
    if s.use_kl_loss and x.ref_logprobs is not None:
        kl_tok = kl_penalty(lp, x.ref_logprobs.detach(), kind=s.kl_loss_type)
        kl_loss = aggregate(kl_tok, mask, seq_ids, **agg)
        total = total + s.kl_loss_coef * kl_loss
        metrics["loss/kl"] = kl_loss.detach()
        metrics["actor/kl_ref"] = aggregate(kl_tok.detach(), mask, seq_ids, **tok_mean)
    if x.entropy is not None:
        ent_loss = aggregate(x.entropy, mask, seq_ids, **agg)
        if s.entropy_coeff:
            total = total - s.entropy_coeff * ent_loss
        metrics["loss/entropy"] = ent_loss.detach()
        metrics["actor/entropy"] = aggregate(x.entropy.detach(), mask, seq_ids, **tok_mean)
    metrics["loss/total"] = total.detach()
    return total, metrics


def value_loss(
    *,
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    global_tokens: float,
    global_seqs: float,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    norm_len: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's clipped value loss (PPO's, as verl's ``compute_value_loss``).

    All [N]: ``vpreds`` the current critic's values (with grad); ``values`` the critic's values before
    the step; ``returns`` the targets. Per token ``max((v - R)^2, (clip(v, V - c, V + c) - R)^2)``,
    aggregated by ``loss_agg_mode`` (``norm_len``: its seq-mean-token-sum-norm constant), times 0.5.
    Returns the loss share and summable metrics (see the module docstring).
    """
    mask = mask.to(vpreds.dtype)
    clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss1, loss2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    agg = dict(global_tokens=global_tokens, global_seqs=global_seqs)
    loss = 0.5 * aggregate(torch.maximum(loss1, loss2), mask, seq_ids, mode=loss_agg_mode, norm_len=norm_len, **agg)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": aggregate((loss2 > loss1).float(), mask, seq_ids, mode="token-mean", **agg),
        "critic/vpred_mean": aggregate(vpreds.detach(), mask, seq_ids, mode="token-mean", **agg),
    }
    return loss, metrics


PolicyLossFn = Callable[[PolicyLossInputs, AlgorithmConfig], tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""``algorithm.policy_loss.loss_mode`` -> the loss; each name also has a config class
(:data:`tether.config.policy_loss.POLICY_LOSS_CONFIGS`)."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: ``fn`` is the loss ``loss_mode: name`` selects. It takes ``(inputs, settings)`` as
    :func:`policy_loss` does and reads its own knobs from ``settings.policy_loss`` (its config class)."""

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return add


register_policy_loss("vanilla")(policy_loss)


def get_policy_loss(name: str) -> PolicyLossFn:
    return lookup(POLICY_LOSSES, name, key="algorithm.policy_loss.loss_mode", what="loss function",
                  decorator="register_policy_loss")  # fmt: skip
