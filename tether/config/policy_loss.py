"""``algorithm.policy_loss``: which policy loss trains the actor, and that loss's own knobs.

verl's ``policy_loss.loss_mode`` is the tag: ``{loss_mode: vanilla}`` selects :class:`VanillaLoss`, and a
new loss is one config class here decorated with :func:`register_policy_loss_config`, beside its function
in ``learner/losses.py``. The knobs every loss shares (clip ratios, importance sampling, KL, entropy,
aggregation) stay in the ``algorithm`` section under verl's names; a loss's config class holds only what
is its own.

An open registry rather than a closed ``Union[...]`` so a class registered from elsewhere (a test's toy)
is validated at load time exactly like a built-in one: an unknown ``loss_mode`` or a misspelt knob is a
config error naming the key, before torch is imported.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from tether.config.base import Section


class PolicyLossConfig(Section):
    """The base of every policy loss's config: ``loss_mode`` names the loss, a subclass adds its knobs."""

    loss_mode: str
    """The policy loss (verl's ``policy_loss.loss_mode``); each has its own config class."""


POLICY_LOSS_CONFIGS: dict[str, type[PolicyLossConfig]] = {}
"""``loss_mode`` -> its config class; the learner keys the loss functions on the same names."""

C = TypeVar("C", bound=type[PolicyLossConfig])


def register_policy_loss_config(cls: C) -> C:
    """Class decorator: make ``cls`` the config of the loss its ``loss_mode`` default names."""
    name = cls.model_fields["loss_mode"].default
    if not isinstance(name, str):
        raise TypeError(f"{cls.__name__}: give loss_mode a default, e.g. loss_mode: Literal['mine'] = 'mine'")
    if name in POLICY_LOSS_CONFIGS:
        raise ValueError(f"policy loss config {name!r} is registered twice")
    POLICY_LOSS_CONFIGS[name] = cls
    return cls


@register_policy_loss_config
class VanillaLoss(PolicyLossConfig):
    """Decoupled PPO-clip (``learner.losses.policy_loss``); GRPO, Dr.GRPO and DAPO are settings of it.

    Its knobs are the ``algorithm`` section's shared ones (``clip_ratio_low/high/c``, ``tis_*``, KL,
    entropy, ``loss_agg_mode``), where verl keeps them too."""

    loss_mode: Literal["vanilla"] = "vanilla"
    """Decoupled PPO-clip with asymmetric and dual clip, truncated importance sampling, KL and entropy."""


def policy_loss_config_class(loss_mode: object) -> type[PolicyLossConfig]:
    """The config class registered for ``loss_mode``; a ValueError listing the known ones otherwise."""
    try:
        return POLICY_LOSS_CONFIGS[loss_mode]  # type: ignore[index]
    except (KeyError, TypeError):
        known = ", ".join(sorted(POLICY_LOSS_CONFIGS))
        raise ValueError(f"unknown loss_mode {loss_mode!r}; known: {known}") from None


def as_policy_loss_config(value: Any) -> Any:
    """A before-validator's work: a mapping becomes the config class its ``loss_mode`` names (``vanilla``
    when it names none, as verl's default)."""
    if isinstance(value, dict):
        return policy_loss_config_class(value.get("loss_mode", "vanilla")).model_validate(value)
    return value
