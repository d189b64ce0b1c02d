"""``algorithm.adv_estimator``: the advantage estimators a config may name, and what each needs.

An open registry under verl's names (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_plus_plus``,
``reinforce_plus_plus_baseline``, ``gae``), like the policy losses': an estimator is declared here with
what it needs from the rest of the run, and its function is registered under the same name in
``learner/advantages.py`` (``@register_adv_est``, which declares it too when given its needs). What an
estimator may need:

- ``needs_critic``: the critic's values of the step's tokens — the learner builds and trains a critic
  (the ``critic`` section). ``critic.enable: false`` refuses such an estimator, and so does Ulysses
  sequence parallelism (the critic plans over all ranks).
- ``needs_reference``: the frozen reference model's log-probs of the step's tokens (``ref_logprobs``) —
  the learner loads the reference, as it does for ``use_kl_loss``.

Checked when the config is loaded, before torch is imported: an unknown name is an error listing the known
ones, a missing requirement an error naming it (:func:`check_estimator_needs`, called by the whole
config's validator, since the critic and the learner are other sections). A run validates its config
before importing anything else, so the estimator a run uses is declared here (a test may declare its toy
from the test file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tether.config.root import TetherConfig


@dataclass(frozen=True)
class AdvEstimatorSpec:
    """What one estimator needs beside the step's rewards, loss masks and groups."""

    name: str
    needs_critic: bool = False
    """It reads the critic's values (``AdvantageBatch.values``): the learner runs a critic."""
    needs_reference: bool = False
    """It reads the reference model's log-probs (``AdvantageBatch.ref_logprobs``): the learner loads one."""


ADV_ESTIMATORS: dict[str, AdvEstimatorSpec] = {}
"""``adv_estimator`` name -> what it needs; ``learner.advantages.ESTIMATORS`` keys the functions alike."""


def declare_adv_estimator(name: str, *, needs_critic: bool = False, needs_reference: bool = False) -> AdvEstimatorSpec:
    """Make ``name`` a valid ``algorithm.adv_estimator`` with these needs; declaring it again the same way is
    a no-op, differently an error."""
    spec = AdvEstimatorSpec(name, needs_critic=needs_critic, needs_reference=needs_reference)
    old = ADV_ESTIMATORS.setdefault(name, spec)
    if old != spec:
        raise ValueError(f"advantage estimator {name!r} is declared twice with different needs: {old} and {spec}")
    return spec


def adv_estimator_spec(name: object) -> AdvEstimatorSpec:
    """The declaration of ``name``; a ValueError listing the known estimators otherwise."""
    try:
        return ADV_ESTIMATORS[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"unknown estimator {name!r}; known: {', '.join(sorted(ADV_ESTIMATORS))}") from None


def _without(need: str) -> str:
    return ", ".join(sorted(n for n, s in ADV_ESTIMATORS.items() if not getattr(s, need))) or "none"


def _with(need: str) -> str:
    return ", ".join(sorted(n for n, s in ADV_ESTIMATORS.items() if getattr(s, need))) or "none"


def check_estimator_needs(cfg: TetherConfig) -> None:
    """Raise a ValueError naming what ``algorithm.adv_estimator`` needs and the config lacks (or what the
    config turns on that it does not use)."""
    spec = adv_estimator_spec(cfg.algorithm.adv_estimator)
    name = spec.name
    if spec.needs_critic:
        if cfg.critic.enable is False:
            raise ValueError(
                f"algorithm.adv_estimator: {name} needs a critic, and critic.enable is false — drop "
                f"critic.enable (a critic is built when the estimator needs one), or use an estimator without "
                f"one: {_without('needs_critic')}"
            )
        if cfg.learner.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                f"algorithm.adv_estimator: {name} needs a critic, which does not run with "
                "learner.ulysses_sequence_parallel_size > 1 yet (it plans over all ranks) — set it to 1, or use "
                f"an estimator without a critic: {_without('needs_critic')}"
            )
    elif cfg.critic.enable:
        raise ValueError(
            f"critic.enable is true, but algorithm.adv_estimator: {name} reads no values — the critic would train "
            f"for nothing; drop critic.enable, or use an estimator with a critic: {_with('needs_critic')}"
        )


# The built-ins, verl's names; their functions are in learner/advantages.py.
declare_adv_estimator("grpo")
declare_adv_estimator("dr_grpo")
declare_adv_estimator("rloo")
declare_adv_estimator("reinforce_plus_plus")
declare_adv_estimator("reinforce_plus_plus_baseline")
declare_adv_estimator("gae", needs_critic=True)
