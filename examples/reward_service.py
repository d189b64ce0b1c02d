"""An example reward service, its own process: math answers scored against the dataset's answer.

    python examples/reward_service.py --port 50070 [--token TOKEN]     # or TETHER_AUTH_TOKEN=...

A completion earns 1.0 when its final answer — the last ``\\boxed{...}``, else the last number in the
text — equals ``reward_context["answer"]`` numerically (``1,000`` = ``1000`` = ``1000.0``, ``1/2`` =
``0.5``), else 0.0. Components: ``correct`` and ``boxed`` (whether a ``\\boxed{}`` was given).
A request without the answer key is the caller's mistake: INVALID_ARGUMENT.

Point rollout servers at it with ``rollout.reward: {type: remote, address: host:50070}``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from fractions import Fraction
from pathlib import Path

# Runs from a checkout without installing: make the repo's `tether` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.reward_service import RewardService, serve
from tether.v1 import reward_pb2

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced (``\\boxed{\\frac{1}{2}}`` works)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: no well-formed answer


def final_answer(text: str) -> tuple[str | None, bool]:
    """``(answer, boxed)``: the boxed answer when there is one, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    numbers = _NUMBER.findall(text)
    return (numbers[-1] if numbers else None), False


def as_number(text: str) -> Fraction | None:
    cleaned = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    frac = re.fullmatch(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", cleaned)
    if frac:
        cleaned = f"{frac.group(1)}/{frac.group(2)}"
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def is_equal(given: str, reference: str) -> bool:
    a, b = as_number(given), as_number(reference)
    if a is not None and b is not None:
        return a == b
    return given.strip() == reference.strip()


class MathReward(RewardService):
    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key

    def score(self, req: reward_pb2.ScoreRequest) -> tuple[float, dict[str, float]]:
        if self.answer_key not in req.reward_context:
            raise ValueError(f"reward_context has no {self.answer_key!r} (keys: {sorted(req.reward_context)})")
        reference = req.reward_context[self.answer_key]
        if not reference.strip():
            raise ValueError(f"reward_context[{self.answer_key!r}] is empty")
        answer, boxed = final_answer(req.completion)
        correct = answer is not None and is_equal(answer, reference)
        return float(correct), {"correct": float(correct), "boxed": float(boxed)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=50070)
    p.add_argument("--host", default="0.0.0.0", help="bind address (default all interfaces)")
    p.add_argument("--token", default=os.environ.get("TETHER_AUTH_TOKEN", ""), help="required bearer token")
    p.add_argument("--answer-key", default="answer", help="reward_context key of the reference answer")
    args = p.parse_args(argv)
    serve(MathReward(args.answer_key), port=args.port, host=args.host, token=args.token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
