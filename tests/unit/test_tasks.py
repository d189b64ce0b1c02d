"""The demo task: seeded prompts, and a reward that separates right from wrong classes."""

from __future__ import annotations

import itertools

import pytest

from tether.tasks import CHAR_CLASSES, demo_reward, demo_rows


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
