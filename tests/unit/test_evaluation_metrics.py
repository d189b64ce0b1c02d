"""Evaluation metrics against hand-computed references: unbiased pass@k, mean@k, pass@k, missing prompts."""

from __future__ import annotations

import math

import pytest

from buffer.validation import ValResult
from learner.evaluation import pass_at_k, summarize


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),
        (4, 2, 2, 1 - 1 / 6),  # C(2,2)/C(4,2) = 1/6 of the pairs miss both passes
        (4, 1, 4, 1.0),
        (5, 1, 2, 1 - math.comb(4, 2) / math.comb(5, 2)),  # = 0.4
        (3, 3, 2, 1.0),
    ],
)
def test_pass_at_k_unbiased_estimator(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_needs_enough_samples() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        pass_at_k(2, 1, 3)


def _r(index: int, rewards: list[float], error: str = "") -> ValResult:
    return ValResult(round=1, index=index, version=2, rewards=rewards, versions=[2] * len(rewards),
                     tokens=3 * len(rewards), error=error)  # fmt: skip


def test_summary_matches_a_hand_reference() -> None:
    # Prompt 0 passes 1 of 4, prompt 1 none (partial credit 0.5 is not a pass), prompt 2 all 4.
    # A fourth prompt failed on the server and a fifth never came back: both are missing.
    results = [
        _r(0, [1.0, 0.0, 0.0, 0.0]),
        _r(1, [0.5, 0.0, 0.5, 0.0]),
        _r(2, [1.0, 1.0, 1.0, 1.0]),
        _r(3, [], error="reward failed: down"),
    ]
    m = summarize(results, k=4, expected=5)
    assert m["val/prompts"] == 3
    assert m["val/missing"] == 2
    assert m["val/reward_mean"] == pytest.approx((1 + 1 + 4) / 12)
    assert m["val/mean@k"] == pytest.approx((0.25 + 0.25 + 1.0) / 3)
    assert m["val/pass@k"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a passing sample
    assert m["val/pass@1"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert m["val/best@k"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert m["val/k"] == 4
    assert m["val/tokens_mean"] == pytest.approx(3.0)


def test_mean_at_k_weighs_prompts_equally_when_sample_counts_differ() -> None:
    m = summarize([_r(0, [1.0]), _r(1, [0.0, 0.0, 0.0])], k=3, expected=2)
    assert m["val/mean@k"] == pytest.approx(0.5)
    assert m["val/reward_mean"] == pytest.approx(0.25)


def test_a_round_with_no_results_reports_only_missing() -> None:
    m = summarize([], k=2, expected=7)
    assert m == {"val/k": 2.0, "val/prompts": 0.0, "val/missing": 7.0}
