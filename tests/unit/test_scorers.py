"""Built-in scorers on tricky answers, the data-source routes, and per-source evaluation metrics."""

from __future__ import annotations

import random

import pytest

from buffer.evaluation import ValResult
from learner.evaluation import summarize, summarize_by_source
from rollout_server.rewards import RewardError, ScoreItem, SourceReward
from tether.config import ConfigError, TetherConfig, load_config
from tether.scorers import SCORERS, gsm8k_answer, unrouted
from tether.v1.trajectory_pb2 import Prompt


@pytest.mark.parametrize(
    ("completion", "reference", "correct"),
    [
        ("She pays 3 * 6 = 18 dollars.\n#### 18", "18", True),
        ("#### 1,234", "1234", True),  # thousands separator
        ("#### $1,234.", "1234", True),  # a dollar sign and a trailing period
        ("#### 18.00", "18", True),
        ("#### 18 dollars", "18", True),  # a unit after the number
        ("#### -5", "-5", True),
        ("#### 0.5", "1/2", True),
        ("#### 17", "18", False),
        ("The answer is 18.", "18", False),  # no #### (verl's strict rule)
        ("#### 12\nwait, no: #### 18", "18", True),  # the last one counts
        ("#### 18", "Natalia sold 48/2 = 24 clips.\n#### 18", True),  # a whole solution as reference
    ],
)
def test_gsm8k_scorer(completion: str, reference: str, correct: bool) -> None:
    reward, parts = SCORERS["gsm8k"](completion, {"answer": reference})
    assert reward == float(correct) and parts["correct"] == float(correct)


@pytest.mark.parametrize(
    ("completion", "reference", "correct"),
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac12", True),  # \frac12 shorthand
        ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", True),
        ("\\boxed{90^\\circ}", "90", True),
        ("\\boxed{50\\%}", "50", True),
        ("\\boxed{\\text{(B)}}", "(B)", True),
        ("\\boxed{10.}", "10", True),  # trailing period
        ("\\boxed{1,000}", "1000", True),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True),
        ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", False),
        ("the answer is 42", "42", False),  # MATH: no box, no credit
    ],
)
def test_math_scorer_is_boxed_normalised_exact_match(completion: str, reference: str, correct: bool) -> None:
    reward, _ = SCORERS["math"](completion, {"answer": reference})
    assert reward == float(correct)
    assert SCORERS["math_any"]("the answer is 42", {"answer": "42"})[0] == 1.0


def test_gsm8k_answer_extraction() -> None:
    assert gsm8k_answer("#### 1,000,000.") == "1000000"
    assert gsm8k_answer("no marker 12") is None


def test_routes_know_verl_sources_and_config_refuses_unknown_scorers() -> None:
    assert unrouted({"openai/gsm8k", "lighteval/MATH", "addition", "mine"}, {}) == ["mine"]
    assert unrouted({"mine"}, {"mine": "math"}) == []
    with pytest.raises(ConfigError, match="unknown scorer 'regex'"):
        load_config(None, ["--rollout.reward", "{type: data_source, scorers: {mine: regex}}"])
    with pytest.raises(ConfigError, match=r"is 'remote' but rollout.reward.remote is not set"):
        load_config(None, ["--rollout.reward", "{type: data_source, scorers: {mine: remote}}"])


def _item(completion: str, **ctx: str) -> ScoreItem:
    return ScoreItem("q", completion, [1], [2], ctx, "t")


async def test_source_reward_routes_each_completion() -> None:
    cfg = TetherConfig.model_validate({"rollout": {"reward": {"type": "data_source", "scorers": {"x": "exact_match"}}}})
    reward = SourceReward(cfg)
    got = await reward.score([
        _item("#### 7", answer="7", data_source="openai/gsm8k"),
        _item("\\boxed{7}", answer="7", data_source="openai/gsm8k"),  # gsm8k wants ####
        _item("\\boxed{7}", answer="7", data_source="lighteval/MATH"),
        _item(" hi ", answer="hi", data_source="x"),
        _item("555", answer="055", task="addition", data_source="addition"),
    ])  # fmt: skip
    assert [r for r, _ in got] == [1.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(RewardError, match="no scorer for data_source 'y'"):
        await reward.score([_item("a", answer="a", data_source="y")])
    with pytest.raises(RewardError, match="has no 'answer'"):
        await reward.score([_item("a", data_source="x")])


def test_validation_metrics_per_source_match_a_reference_on_random_results() -> None:
    rng = random.Random(0)
    sources = [rng.choice(["openai/gsm8k", "lighteval/MATH", "addition"]) for _ in range(40)]
    prompts = [Prompt(dataset_index=i, reward_context={"data_source": s}) for i, s in enumerate(sources)]
    results = [ValResult(round=1, index=i, version=0, rewards=[float(rng.random() < 0.4) for _ in range(4)], tokens=8)
               for i in range(40) if rng.random() < 0.9]  # fmt: skip
    out = summarize_by_source(results, prompts, k=4)
    for source in set(sources):
        mine = [r for r in results if sources[r.index] == source]
        samples = [x for r in mine for x in r.rewards]
        assert out[f"val/{source}/reward_mean"] == pytest.approx(sum(samples) / len(samples))
        assert out[f"val/{source}/pass@k"] == pytest.approx(sum(max(r.rewards) >= 1 for r in mine) / len(mine))
        assert out[f"val/{source}/missing"] == sources.count(source) - len(mine)
    whole = summarize(results, k=4, expected=40)
    assert sum(out[f"val/{s}/prompts"] for s in set(sources)) == whole["val/prompts"]
