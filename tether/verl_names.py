"""tether's metric names → the names verl logs for the same quantity, for experiment trackers.

A verl user's W&B or MLflow dashboards are keyed on verl's curve names (``actor/pg_loss``,
``critic/score/mean``, ``response_length/mean``, ``timing_s/step``...). Every tracker in ``run.loggers``
(console, TensorBoard, W&B, MLflow, trackio) receives a step's metrics renamed through :data:`VERL_NAMES`,
so those dashboards work on a tether run unchanged; ``metrics.jsonl``, the plots and ``tether status`` keep
tether's own names. A key is renamed only where the quantity is the same as verl's (same numerator, same
denominator, same aggregation); every other key reaches the trackers under tether's name. The table in
``docs/TRACKERS.md`` lists this map, and a test keeps the two equal.

Where verl logs one quantity under two names (the score is also the reward when no KL penalty is folded
into the reward, which tether never does), the value is sent under both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

VERL_NAMES: dict[str, tuple[str, ...]] = {
    # the policy loss and its parts (learner/losses.py; verl workers/utils/losses.py, core_algos)
    "loss/pg": ("actor/pg_loss",),
    "loss/kl": ("actor/kl_loss",),
    "loss/entropy": ("actor/entropy_loss",),
    "loss/total": ("actor/loss",),
    "actor/clipfrac": ("actor/pg_clipfrac",),
    "actor/clipfrac_dual": ("actor/pg_clipfrac_lower",),
    # truncated importance weights, proximal (old) / behaviour (rollout): verl's rollout correction
    "actor/iw_mean": ("rollout_corr/rollout_is_mean",),
    "actor/iw_max": ("rollout_corr/rollout_is_max",),
    "actor/iw_capped_frac": ("rollout_corr/rollout_is_ratio_fraction_high",),
    # the batch (verl trainer/ppo/metric_utils.compute_data_metrics)
    "reward/mean": ("critic/score/mean", "critic/rewards/mean"),
    "reward/max": ("critic/score/max", "critic/rewards/max"),
    "reward/min": ("critic/score/min", "critic/rewards/min"),
    "response/length_mean": ("response_length/mean",),
    # versions behind the learner, by a sample's oldest token (verl's fully async trainer)
    "staleness/mean": ("training/off_policy/trajectory_staleness_worst/mean",),
    "staleness/max": ("training/off_policy/trajectory_staleness_worst/max",),
    # time and throughput (compute_timing_metrics, compute_throughout_metrics; the fully async trainer's
    # "gen" is its wait for samples from the queue, as tether's learner waits for groups from Redis)
    "timing/step": ("timing_s/step", "perf/time_per_step"),
    "timing/wait_data": ("timing_s/gen",),
    "timing/weight_sync": ("timing_s/param_sync",),
    "learner/tokens": ("perf/total_num_tokens",),
    "perf/mfu": ("perf/mfu/actor",),
}
"""tether key → the verl name(s) a tracker receives it under. Keys verl already shares with tether
(``actor/ppo_kl``, ``actor/entropy``, ``actor/grad_norm``, ``actor/lr``, ``critic/vf_loss``,
``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, ``critic/vf_explained_var``,
``critic/values/mean``, ``critic/returns/mean``) pass unchanged. Left out on purpose: ``perf/tokens_per_s``
(tokens over the compute time of all ranks together; verl's ``perf/throughput`` is per GPU over the whole
step) and ``val/*`` (verl names validation curves per data source, ``val-core/<source>/...``)."""


def to_verl_names(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with each key of :data:`VERL_NAMES` replaced by its verl name(s); other keys as they are."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        for name in VERL_NAMES.get(key, (key,)):
            out[name] = value
    return out
