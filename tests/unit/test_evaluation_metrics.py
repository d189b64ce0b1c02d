"""Evaluation metrics against hand-computed references: unbiased pass@k, mean@k, pass@k, missing prompts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from buffer.evaluation import ValResult
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


# --- configuration and the evaluation set ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--learner.test_freq", "5"], "set learner.val_data_path"),
        (["--learner.val_before_train", "true"], "set learner.val_data_path"),
        (["--learner.val_data_path", "demo:chess"], "val_data_path: unknown demo task 'chess'"),
        (["--learner.val_data_path", "demo:addition", "--learner.val_n", "4"], "learner.val_temperature > 0"),
        (["--learner.val_n", "0"], "val_n"),
    ],
)
def test_bad_evaluation_config_names_the_key(overrides: list[str], message: str) -> None:
    from tether.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_jsonl_evaluation_set_keeps_its_rows_and_caps_them(tmp_path: Path) -> None:
    from learner.evaluation import load_val_prompts
    from tether.config import load_config

    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+{i}=", "answer": str(2 * i), "level": i}) + "\n" for i in range(5)))
    cfg = load_config(None, ["--learner.val_data_path", str(path), "--learner.prompt_key", "q",
                             "--learner.val_max_prompts", "3"])  # fmt: skip
    prompts = load_val_prompts(cfg)
    assert [p.text for p in prompts] == ["0+0=", "1+1=", "2+2="]
    assert [p.dataset_index for p in prompts] == [0, 1, 2]  # the index a result is matched back by
    assert dict(prompts[2].reward_context) == {"answer": "4", "level": "2"}


def test_bad_jsonl_evaluation_set_names_val_data_path(tmp_path: Path) -> None:
    from learner.evaluation import load_val_prompts
    from tether.config import load_config

    path = tmp_path / "val.jsonl"
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"^learner\.val_data_path: .*:2 is not JSON"):
        load_val_prompts(load_config(None, ["--learner.val_data_path", str(path)]))


def test_demo_evaluation_set_is_the_heldout_split() -> None:
    from learner.evaluation import load_val_prompts
    from tether.config import load_config
    from tether.tasks import addition_split

    prompts = load_val_prompts(load_config(None, ["--learner.val_data_path", "demo:addition"]))
    assert len(prompts) == 128
    pairs = [tuple(int(x) for x in p.text.removesuffix("=").split("+")) for p in prompts]
    assert all(addition_split(a, b) == "val" for a, b in pairs)
