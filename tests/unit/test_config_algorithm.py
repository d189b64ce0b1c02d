"""The ``algorithm`` and ``critic`` settings that must mean what verl means by them."""

from __future__ import annotations

import pytest

from tether.config import ConfigError, load_config


def _load(*overrides: str):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("std", [[], ["--algorithm.norm_adv_by_std_in_grpo", "false"]])
def test_dr_grpo_aggregates_seq_mean_token_sum_norm_without_the_std(std: list[str]) -> None:
    """Dr.GRPO is both settings; with the std flag written out as false it kept token-mean before."""
    a = _load("--algorithm.adv_estimator", "dr_grpo", *std).algorithm
    assert a.loss_agg_mode == "seq-mean-token-sum-norm" and not a.norm_adv_by_std_in_grpo


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--algorithm.norm_adv_by_std_in_grpo", "true"], "no std normalisation"),
     (["--algorithm.loss_agg_mode", "token-mean"], "seq-mean-token-sum-norm, not token-mean")],
)  # fmt: skip
def test_dr_grpo_refuses_a_setting_that_contradicts_it(extra: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _load("--algorithm.adv_estimator", "dr_grpo", *extra)


def test_the_critic_aggregates_like_the_actor_unless_told() -> None:
    """verl's ``critic.loss_agg_mode`` defaults to the actor's ``loss_agg_mode``; tether's was always token-mean."""
    cfg = _load("--algorithm.adv_estimator", "gae", "--algorithm.loss_agg_mode", "seq-mean-token-mean")
    assert cfg.critic.loss_agg_mode is None  # follows the actor's, resolved where the loss is built
    own = _load("--critic.loss_agg_mode", "seq-mean-token-sum")
    assert own.critic.loss_agg_mode == "seq-mean-token-sum"


def test_an_unknown_estimator_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"algorithm\.adv_estimator: unknown estimator 'gea'; known: dr_grpo, gae, grpo"
    ):
        _load("--algorithm.adv_estimator", "gea")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--algorithm.adv_estimator", "gae", "--critic.enable", "false"],
         r"adv_estimator: gae needs a critic, and critic\.enable is false .* without one: dr_grpo, grpo"),
        (["--algorithm.adv_estimator", "gae", "--learner.ulysses_sequence_parallel_size", "2"],
         r"gae needs a critic, which does not run with learner\.ulysses_sequence_parallel_size > 1"),
        (["--critic.enable", "true"], r"critic\.enable is true, but algorithm\.adv_estimator: grpo reads no values"),
    ],
)  # fmt: skip
def test_an_estimator_without_what_it_needs_is_refused_at_load(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _load(*overrides)


def test_the_critic_follows_the_estimator_unless_told() -> None:
    gae = _load("--algorithm.adv_estimator", "gae")
    assert gae.critic.enable is None and gae.algorithm.estimator.needs_critic
    assert _load("--algorithm.adv_estimator", "gae", "--critic.enable", "true").algorithm.estimator.needs_critic
    assert not _load().algorithm.estimator.needs_critic
    assert not _load().algorithm.uses_reference and _load("--algorithm.use_kl_loss", "true").algorithm.uses_reference
