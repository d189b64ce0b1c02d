"""An example reward service, its own process: math answers scored against the dataset's answer.

    python examples/reward_service.py --port 50070 [--token TOKEN]     # or TETHER_AUTH_TOKEN=...

A completion earns 1.0 when its final answer — the last ``\\boxed{...}``, else the last number in the
text — equals ``reward_context["answer"]`` numerically (``1,000`` = ``1000`` = ``1000.0``, ``1/2`` =
``0.5``), else 0.0; the scoring is tether's built-in math reward, so only the service is new here.
A request without the answer key is the caller's mistake: INVALID_ARGUMENT.

Point rollout servers at it with ``rollout.reward: {type: remote, address: host:50070}``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

# Runs from a checkout without installing: make the repo's `tether` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.reward_service import RewardService, serve
from tether.scorers import math_reward
from tether.v1 import reward_pb2


class MathReward(RewardService):
    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key
        self.scored = itertools.count()  # next() is atomic under the GIL; score() runs in worker threads

    def score(self, req: reward_pb2.ScoreRequest) -> tuple[float, dict[str, float]]:
        if self.answer_key not in req.reward_context:
            raise ValueError(f"reward_context has no {self.answer_key!r} (keys: {sorted(req.reward_context)})")
        reference = req.reward_context[self.answer_key]
        if not reference.strip():
            raise ValueError(f"reward_context[{self.answer_key!r}] is empty")
        next(self.scored)
        return math_reward(req.completion, reference)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=50070)
    p.add_argument("--host", default="0.0.0.0", help="bind address (default all interfaces)")
    p.add_argument("--token", default=os.environ.get("TETHER_AUTH_TOKEN", ""), help="required bearer token")
    p.add_argument("--answer-key", default="answer", help="reward_context key of the reference answer")
    args = p.parse_args(argv)
    service = MathReward(args.answer_key)
    serve(service, port=args.port, host=args.host, token=args.token)
    print(f"reward service stopped after scoring {next(service.scored)} completions", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
