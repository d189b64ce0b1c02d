"""``algorithm.policy_loss``: the loss's tagged config and the registries' agreement.

The toy loss defined the way docs/EXTENDING.md says is in ``tests/integration/test_extending.py``; here the
config side alone: which class a ``loss_mode`` selects, and the errors a user sees (the pre-0.1 key
``algorithm.loss_mode`` among them: an unknown key).
"""

from __future__ import annotations

import warnings

import pytest

from learner.losses import POLICY_LOSSES, get_policy_loss, policy_loss
from tether.config import ConfigError, load_config
from tether.config.policy_loss import POLICY_LOSS_CONFIGS, VanillaLoss


def test_default_and_explicit_loss_is_vanilla() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new place warns about nothing
        for overrides in ([], ["--algorithm.policy_loss.loss_mode", "vanilla"], ["--algorithm.policy_loss", "{}"]):
            assert load_config(None, overrides).algorithm.policy_loss == VanillaLoss()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["--algorithm.policy_loss.loss_mode", "vanila"],
            "algorithm.policy_loss: unknown loss_mode 'vanila'; known: vanilla",
        ),
        (["--algorithm.loss_mode", "vanilla"], "algorithm.loss_mode: unknown key"),
        (["--algorithm.policy_loss.clip", "1"], "algorithm.policy_loss.clip: unknown key"),
    ],
)
def test_bad_loss_config_names_the_key(overrides: list[str], needle: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
    assert needle in str(e.value)


def test_every_configurable_loss_has_a_function_and_documented_knobs() -> None:
    assert set(POLICY_LOSS_CONFIGS) == set(POLICY_LOSSES)
    assert get_policy_loss("vanilla") is policy_loss
    for name, cls in POLICY_LOSS_CONFIGS.items():
        assert cls().loss_mode == name
        assert all(f.description for f in cls.model_fields.values()), cls
    with pytest.raises(ValueError, match=r"no loss function for 'nope'.*register_policy_loss\('nope'\)"):
        get_policy_loss("nope")
