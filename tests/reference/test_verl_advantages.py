"""tether's advantage estimators (``learner/advantages.py``) against verl 0.9.1's own, called.

Each tether estimator (``ESTIMATORS[name].fn``) and the verl function of the same name
(``core_algos.get_adv_estimator_fn``, the registry verl's trainer dispatches on) get the same seeded batch
(:mod:`tests.reference.inputs`: right-padded and multi-turn masks with holes, fully-masked samples, groups
of one, a group with all-equal rewards, shuffled order) with the reward on each sample's last trained token,
and verl gets the group ids as its trainer does, one string uid per prompt. Advantages and returns are
compared on the trained tokens: what an estimator leaves under mask 0 never enters a loss (every
aggregation masks), and verl zeroes it where tether may not.

- grpo (std on and off) and dr_grpo (= verl grpo with ``norm_adv_by_std_in_grpo=False``), rloo,
  reinforce_plus_plus (gamma 1.0 and 0.9, verl's ``AlgoConfig``), reinforce_plus_plus_baseline,
  gae with (gamma, lam) in (1, 1), (0.99, 0.95), (0.9, 0).

float64 only: tether's estimators take the float64 batch ``advantage_batch`` builds (``AdvantageBatch``).
No reference here: tether's ``masked_whiten`` with fewer than two trained tokens (verl raises).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from learner.advantages import ESTIMATORS, AdvantageBatch
from tests.reference.inputs import Batch, check, make_batch, per_token
from tether.config.algorithm import AlgorithmConfig

SEEDS = (0, 1, 2)
CASES = [
    pytest.param("grpo", {"norm_adv_by_std_in_grpo": True}, id="grpo-std"),
    pytest.param("grpo", {"norm_adv_by_std_in_grpo": False}, id="grpo-nostd"),
    pytest.param("dr_grpo", {}, id="dr_grpo"),
    pytest.param("rloo", {}, id="rloo"),
    pytest.param("reinforce_plus_plus", {"gamma": 1.0}, id="reinforce_plus_plus-g1"),
    pytest.param("reinforce_plus_plus", {"gamma": 0.9}, id="reinforce_plus_plus-g0.9"),
    pytest.param("reinforce_plus_plus_baseline", {}, id="reinforce_plus_plus_baseline"),
    pytest.param("gae", {"gamma": 1.0, "lam": 1.0}, id="gae-g1-l1"),
    pytest.param("gae", {"gamma": 0.99, "lam": 0.95}, id="gae-g0.99-l0.95"),
    pytest.param("gae", {"gamma": 0.9, "lam": 0.0}, id="gae-g0.9-l0"),
]


def _verl_estimate(verl: types.SimpleNamespace, name: str, knobs: dict, batch: Batch, values: torch.Tensor | None):
    """verl's estimator, called with the arguments verl's ``compute_advantage`` passes it."""
    ca = verl.core_algos
    rewards, mask = batch.token_rewards.clone(), batch.mask.clone()
    uid = np.array([f"prompt-{g}" for g in batch.group_ids.tolist()], dtype=object)
    if name == "gae":
        return ca.compute_gae_advantage_return(
            token_level_rewards=rewards, values=values, response_mask=mask, gamma=knobs["gamma"], lam=knobs["lam"]
        )
    if name in ("grpo", "dr_grpo"):
        return ca.get_adv_estimator_fn("grpo")(
            token_level_rewards=rewards,
            response_mask=mask,
            index=uid,
            norm_adv_by_std_in_grpo=name == "grpo" and knobs["norm_adv_by_std_in_grpo"],
        )
    config = verl.AlgoConfig(adv_estimator=name, gamma=knobs.get("gamma", 1.0))
    return ca.get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=uid, config=config)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize(("name", "knobs"), CASES)
def test_estimator_matches_verl(verl: types.SimpleNamespace, name: str, knobs: dict, seed: int) -> None:
    batch = make_batch(seed, dtype=torch.float64)
    values = per_token(batch, seed + 100) if name == "gae" else None
    cfg = AlgorithmConfig(adv_estimator=name, **knobs)
    adv, ret = ESTIMATORS[name].fn(
        AdvantageBatch(token_rewards=batch.token_rewards, mask=batch.mask, group_ids=batch.group_ids, values=values),
        cfg,
    )
    want_adv, want_ret = _verl_estimate(verl, name, knobs, batch, values)
    trained = batch.mask.bool()
    reference = f"verl {verl.version} {name}"
    # verl divides a group of one by ``torch.tensor(1.0) + epsilon``: a float32 constant, so even in a float64
    # batch its 1 + 1e-6 is 1 + 9.54e-7, a relative 5e-8 only a copy of that rounding would reproduce.
    scale = 1e3 if knobs.get("norm_adv_by_std_in_grpo") else 1.0
    for what, got, want in (("advantages", adv, want_adv), ("returns", ret, want_ret)):
        check(got[trained], want[trained], what=f"{name} {what}", reference=reference, dtype=torch.float64, scale=scale)
