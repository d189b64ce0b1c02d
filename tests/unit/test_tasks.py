"""The demo task: seeded prompts, and a reward that separates right from wrong classes."""

from __future__ import annotations

import itertools
import re

import pytest

from tether.tasks import (
    ADDITION_DIGITS,
    CHAR_CLASSES,
    FEWSHOT_PAIRS,
    FEWSHOT_SHOTS,
    SPLITS,
    addition_reward,
    addition_split,
    demo_reward,
    demo_rows,
)


def test_rows_are_seeded_and_cover_every_class() -> None:
    a = list(itertools.islice(demo_rows(seed=3), 60))
    b = list(itertools.islice(demo_rows(seed=3), 60))
    assert a == b
    assert {row["answer"] for row in a} == set(CHAR_CLASSES)
    assert all(row["prompt"] == f"{row['answer']}:" for row in a)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("123", "digits", 1.0),
        ("12ab", "digits", 0.5),
        ("abc", "upper", 0.0),
        ("", "digits", 0.0),
        ("ABC", "nonsense", 0.0),
    ],
)
def test_reward(completion: str, answer: str, expected: float) -> None:
    assert demo_reward(completion, {"answer": answer}) == pytest.approx(expected)


def test_unknown_task_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown demo task"):
        next(demo_rows("nope"))


# --- addition: the task that needs a warm model -------------------------------------------------------
def test_addition_rows_are_seeded_fixed_width_and_correct() -> None:
    rows = list(itertools.islice(demo_rows("addition", seed=5), 200))
    assert rows == list(itertools.islice(demo_rows("addition", seed=5), 200))
    for row in rows:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert len(a) == len(b) == ADDITION_DIGITS and len(row["answer"]) == ADDITION_DIGITS + 1
        assert int(row["answer"]) == int(a) + int(b)
        assert row["task"] == "addition"


def test_addition_heldout_pairs_never_appear_in_training() -> None:
    train = {r["prompt"] for r in itertools.islice(demo_rows("addition", seed=0), 20_000)}
    val = {r["prompt"] for r in itertools.islice(demo_rows("addition", seed=0, split="val"), 500)}
    assert len(val) > 300 and len(train) > 5000  # both splits are well covered...
    assert not train & val  # ...and disjoint
    # Another training seed draws other pairs, never held-out ones: the split is by pair, not by seed.
    assert not {r["prompt"] for r in itertools.islice(demo_rows("addition", seed=9), 5000)} & val
    held_out_share = sum(addition_split(a, b) == "val" for a in range(100) for b in range(100)) / 10_000
    assert 0.05 < held_out_share < 0.15


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("055", "055", 1.0),
        (" 055\n", "055", 1.0),  # surrounding whitespace does not matter
        ("55", "055", 0.0),  # the width is part of the answer
        ("056", "055", 0.0),
        ("0555", "055", 0.0),
        ("", "055", 0.0),
        ("", "", 0.0),
    ],
)
def test_addition_reward_is_exact_match(completion: str, answer: str, expected: float) -> None:
    assert addition_reward(completion, answer) == expected
    assert demo_reward(completion, {"task": "addition", "answer": answer}) == expected


def test_charclass_rows_without_a_task_key_keep_their_reward() -> None:
    assert demo_reward("123", {"answer": "digits"}) == 1.0  # groups written before "task" existed


def test_unknown_split_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown split"):
        next(demo_rows("addition", split="test"))


# --- fewshot_addition: the real-model task ------------------------------------------------------------
QA = re.compile(r"Q: What is (\d) \+ (\d)\?\nA:( \\boxed\{(\d+)\}\n)?")


def _parts(prompt: str) -> tuple[list[tuple[int, int, int]], tuple[int, int]]:
    """The shots ``(a, b, their written sum)`` and the question ``(a, b)`` of a prompt, which they must tile."""
    found = list(QA.finditer(prompt))
    assert "".join(m.group(0) for m in found) == prompt, prompt
    *shots, question = found
    assert question.group(3) is None and all(m.group(3) for m in shots)
    return [(int(m[1]), int(m[2]), int(m[4])) for m in shots], (int(question[1]), int(question[2]))


def test_fewshot_rows_are_seeded_and_their_shots_are_solved_right() -> None:
    rows = list(itertools.islice(demo_rows("fewshot_addition", seed=5), 50))
    assert rows == list(itertools.islice(demo_rows("fewshot_addition", seed=5), 50))
    for row in rows:
        shots, (a, b) = _parts(row["prompt"])
        assert row["answer"] == str(a + b) and not row["prompt"].endswith(" ")
        assert len(shots) == FEWSHOT_SHOTS and all(x + y == s for x, y, s in shots)


def test_fewshot_heldout_pairs_are_never_asked_nor_shown_in_training() -> None:
    val = set(FEWSHOT_PAIRS["val"])
    assert 10 <= len(val) <= 30 and not val & set(FEWSHOT_PAIRS["train"])
    for split in SPLITS:
        asked = set()
        for row in itertools.islice(demo_rows("fewshot_addition", seed=0, split=split), 400):
            shots, question = _parts(row["prompt"])
            assert not {(x, y) for x, y, _ in shots} & val  # held-out pairs are never seen solved
            asked.add(question)
        assert asked == set(FEWSHOT_PAIRS[split])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [(" \\boxed{11}\n", 1.0), (" \\boxed{12}\n", 0.0), (" 11\n", 0.0), (" \\boxed{10} or \\boxed{11}", 1.0)],
)
def test_fewshot_reward_is_the_math_rule_on_the_last_box(completion: str, expected: float) -> None:
    from tether.scorers import SCORERS

    reward, _ = SCORERS["demo"](completion, {"task": "fewshot_addition", "answer": "11"})
    assert reward == expected
    assert SCORERS["math"](completion, {"answer": "11"})[0] == expected


def test_longtail_prompts_carry_a_pareto_length_cap_outside_the_reward_context() -> None:
    from learner.data import demo_prompt
    from tether.tasks import LONGTAIL_MAX_TOKENS, LONGTAIL_MIN_TOKENS

    rows = list(itertools.islice(demo_rows("longtail", seed=3), 4000))
    caps = sorted(int(r["max_tokens"]) for r in rows)
    assert caps[0] == LONGTAIL_MIN_TOKENS and caps[-1] == LONGTAIL_MAX_TOKENS
    assert 7 <= caps[len(caps) // 2] <= 9  # median 8 for P(n >= x) = 4 / x
    assert 0.04 < sum(c >= 64 for c in caps) / len(caps) < 0.08  # one in sixteen
    assert {r["answer"] for r in rows} == {"digits", "lower", "upper"}
    prompt = demo_prompt(rows[0], 0, prompt_id="p0")
    assert prompt.max_tokens == int(rows[0]["max_tokens"]) and "max_tokens" not in prompt.reward_context
    assert prompt.reward_context["data_source"] == "longtail"
    assert demo_reward("123", prompt.reward_context) == (1.0 if rows[0]["answer"] == "digits" else 0.0)
