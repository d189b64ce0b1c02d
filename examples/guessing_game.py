"""An example custom environment, its own process: a number-guessing game played over gRPC episodes.

It needs a rollout server to play against, with a learner to train on what it writes (README, "Examples"):

    tether up --config configs/examples/guessing-game.yaml            # terminal 1: serves on 127.0.0.1:50051
    python examples/guessing_game.py --server 127.0.0.1:50051 --tasks 8 --group-size 4   # terminal 2

It waits up to ``--wait-s`` for the server (its engine loads before it listens), then says which address
did not answer and exits 2.

For each task the environment picks a secret number and opens ``--group-size`` episodes that share a
group id (one GRPO group). Each turn the rollout server generates the model's guess; the environment
answers ``higher``, ``lower`` or ``correct`` (that text is appended as an observation, masked out of
the loss) until the model is right or ``--max-turns`` pass. The episode closes with a reward: 1.0 for a
correct guess, otherwise up to 0.5 for how close the best guess came, 0.0 if no guess was a number.
The server writes each finished group to the trajectories stream; the learner trains on it.

Only ``tether.client`` (thin gRPC stubs) is used: the same protocol works from any language
(docs/OTHER_LANGUAGES.md).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# Runs from a checkout without installing: make the repo's `tether` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.client import RolloutClient

_INTEGER = re.compile(r"-?\d+")
LOW, HIGH = 1, 100


@dataclass
class Outcome:
    reward: float
    turns: int
    solved: bool
    group_written: bool


def first_guess(text: str) -> int | None:
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def reward_for(guesses: list[int], secret: int) -> float:
    if secret in guesses:
        return 1.0
    if not guesses:
        return 0.0
    closest = min(abs(g - secret) for g in guesses)
    return 0.5 * max(0.0, 1.0 - closest / (HIGH - LOW))


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return f"\nPlease answer with a number between {LOW} and {HIGH}.\nGuess: "
    if guess == secret:
        return "\ncorrect\n"
    return f"\n{'higher' if guess < secret else 'lower'}\nGuess: "


def play(client: RolloutClient, *, secret: int, group_id: str, group_size: int, max_turns: int,
         max_tokens: int) -> Outcome:  # fmt: skip
    episode = client.open_episode(
        text=f"I am thinking of a number between {LOW} and {HIGH}. Guess it.\nGuess: ",
        group_id=group_id, group_size=group_size, max_tokens=max_tokens, metadata={"env": "guessing_game"},
    )  # fmt: skip
    guesses: list[int] = []
    observation = ""
    turns = 0
    for turns in range(1, max_turns + 1):  # noqa: B007 - turns is reported
        turn = client.step(episode.episode_id, observation)
        guess = first_guess(turn.text)
        if guess is not None:
            guesses.append(guess)
        if guess == secret:
            break
        observation = feedback(guess, secret)
    reward = reward_for(guesses, secret)
    closed = client.close_episode(
        episode.episode_id, reward=reward, components={"solved": float(secret in guesses), "turns": float(turns)}
    )
    return Outcome(reward=reward, turns=turns, solved=secret in guesses, group_written=closed.group_written)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="host:port of a rollout server")
    parser.add_argument("--token", default=os.environ.get("TETHER_AUTH_TOKEN", ""), help="bearer token, if required")
    parser.add_argument("--tasks", type=int, default=8, help="secret numbers to play (one group each)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per task (GRPO group size)")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per model turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for the server to answer")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []
    with RolloutClient(args.server, token=args.token or None) as client:
        try:
            client.wait_ready(timeout_s=args.wait_s)
        except TimeoutError as e:
            print(f"guessing_game: {e}; tether up --config configs/examples/guessing-game.yaml serves on "
                  "127.0.0.1:50051 (--wait-s to wait longer)", file=sys.stderr)  # fmt: skip
            return 2
        with ThreadPoolExecutor(max_workers=args.group_size) as pool:  # a group's episodes run concurrently
            for task in range(args.tasks):
                secret, group_id = rng.randint(LOW, HIGH), f"guess-{uuid.uuid4().hex}"
                futures = [
                    pool.submit(play, client, secret=secret, group_id=group_id, group_size=args.group_size,
                                max_turns=args.max_turns, max_tokens=args.max_tokens)
                    for _ in range(args.group_size)
                ]  # fmt: skip
                group = [f.result() for f in futures]
                outcomes += group
                mean = sum(o.reward for o in group) / len(group)
                print(f"task {task + 1}/{args.tasks}: secret {secret}, mean reward {mean:.3f}, "
                      f"solved {sum(o.solved for o in group)}/{len(group)}", flush=True)  # fmt: skip
    groups_written = sum(o.group_written for o in outcomes)
    print(f"episodes {len(outcomes)}, groups written {groups_written}, "
          f"mean reward {sum(o.reward for o in outcomes) / len(outcomes):.3f}", flush=True)  # fmt: skip
    return 0 if groups_written == args.tasks else 1


if __name__ == "__main__":
    sys.exit(main())
