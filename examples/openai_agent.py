"""An agent written against the OpenAI API, trained by tether unchanged but for its base URL and an episode id.

The agent plays the number-guessing game of ``examples/guessing_game.py`` as a chat: each turn it sends the whole
conversation to ``/v1/chat/completions`` (as any OpenAI agent does), reads the model's guess, and answers
``higher`` / ``lower`` / ``correct`` as the user. The only tether-specific lines are the three headers that name
the episode and its GRPO group, and the reward it posts at the end:

    tether up --config configs/examples/openai-agent.yaml                      # terminal 1: door on :8000
    python examples/openai_agent.py --base-url http://127.0.0.1:8000/v1 --tasks 8   # terminal 2

Any OpenAI client works the same way (the Agents SDK: ``AsyncOpenAI(base_url=..., default_headers=...)`` passed
to ``OpenAIChatCompletionsModel``; docs/AGENTS.md). The server keeps each episode's token record: what the learner
trains on is exactly what the model sampled, whatever this script does with the text.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

# Runs from a checkout without installing: the charclass task's prompts and reward are tether's own (tether.tasks).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOW, HIGH = 1, 100
_INTEGER = re.compile(r"-?\d+")


def play(client: openai.OpenAI, *, secret: int, group: str, size: int, max_turns: int, max_tokens: int) -> float:
    """One episode: the conversation, then its reward (1.0 solved, up to 0.5 for the closest guess, 0 for none)."""
    episode = f"{group}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Tether-Episode": episode, "X-Tether-Group": group, "X-Tether-Group-Size": str(size)}
    messages = [
        {"role": "system", "content": f"Guess the secret number between {LOW} and {HIGH}. Answer with a number."},
        {"role": "user", "content": "Your guess?"},
    ]
    guesses: list[int] = []
    for _ in range(max_turns):
        out = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens,
                                             extra_headers=headers)  # fmt: skip
        reply = out.choices[0].message
        messages.append({"role": "assistant", "content": reply.content or ""})
        found = _INTEGER.search(reply.content or "")
        if found is None:
            messages.append({"role": "user", "content": f"Please answer with a number between {LOW} and {HIGH}."})
            continue
        guesses.append(int(found.group()))
        if guesses[-1] == secret:
            break
        messages.append({"role": "user", "content": "higher" if guesses[-1] < secret else "lower"})
    if secret in guesses:
        reward = 1.0
    elif guesses:
        reward = 0.5 * max(0.0, 1.0 - min(abs(g - secret) for g in guesses) / (HIGH - LOW))
    else:
        reward = 0.0
    client.post(f"/episodes/{episode}/reward", body={"reward": reward}, cast_to=object)
    return reward


def play_charclass(client: openai.OpenAI, *, row: dict[str, str], group: str, size: int, max_tokens: int,
                   chat: bool) -> float:  # fmt: skip
    """One turn of tether's ``charclass`` demo task ("digits:" → emit digits): the reward is the fraction of the
    reply's characters in the named class — a task the tiny demo model learns in minutes. ``chat``: the prompt
    is a user message (through the chat template); else the raw text on ``/v1/completions``, as the demo's
    prompts stream sends it."""
    from tether.tasks import charclass_reward

    episode = f"{group}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Tether-Episode": episode, "X-Tether-Group": group, "X-Tether-Group-Size": str(size)}
    if chat:
        out = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                             max_tokens=max_tokens, extra_headers=headers)  # fmt: skip
        text = out.choices[0].message.content or ""
    else:
        out = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=max_tokens,
                                        extra_headers=headers)  # fmt: skip
        text = out.choices[0].text
    reward = charclass_reward(text, row["answer"])
    client.post(f"/episodes/{episode}/reward", body={"reward": reward}, cast_to=object)
    return reward


def wait_ready(client: openai.OpenAI, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.models.list()
            return
        except (openai.APIConnectionError, openai.APITimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the rollout server's door, http://host:port/v1")
    parser.add_argument("--api-key", default=os.environ.get("TETHER_AUTH_TOKEN", "-"), help="the run's token")
    parser.add_argument("--tasks", type=int, default=8, help="secret numbers to play (one group each)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per task (GRPO group size)")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per model turn")
    parser.add_argument(
        "--task",
        choices=["guess", "charclass"],
        default="guess",
        help="the guessing game, or tether's charclass demo task (one turn; learnable by the tiny model)",
    )
    parser.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="charclass: prompts as chat messages, or raw text on /v1/completions",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for the server to answer")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2, timeout=300)
    try:
        wait_ready(client, args.wait_s)
    except openai.APIConnectionError as e:
        print(f"openai_agent: {args.base_url} did not answer within {args.wait_s:g}s ({e})", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    rows = None
    if args.task == "charclass":
        from tether.tasks import demo_rows

        rows = demo_rows("charclass", seed=args.seed)
    rewards: list[float] = []
    with ThreadPoolExecutor(max_workers=args.group_size) as pool:  # a group's episodes run concurrently
        for task in range(args.tasks):
            group = f"agent-{uuid.uuid4().hex[:8]}"
            if rows is not None:
                row = next(rows)
                futures = [pool.submit(play_charclass, client, row=row, group=group, size=args.group_size,
                                       max_tokens=args.max_tokens, chat=args.endpoint == "chat")
                           for _ in range(args.group_size)]  # fmt: skip
                what = row["prompt"]
            else:
                secret = rng.randint(LOW, HIGH)
                futures = [
                    pool.submit(play, client, secret=secret, group=group, size=args.group_size,
                                max_turns=args.max_turns, max_tokens=args.max_tokens)
                    for _ in range(args.group_size)
                ]  # fmt: skip
                what = f"secret {secret}"
            try:
                group_rewards = [f.result() for f in futures]
            except openai.APIConnectionError:
                print(f"the server went away after {task} tasks (the run ended?)", flush=True)
                break
            rewards += group_rewards
            print(f"task {task + 1}/{args.tasks}: {what}, mean reward "
                  f"{sum(group_rewards) / len(group_rewards):.3f}", flush=True)  # fmt: skip
    print(f"episodes {len(rewards)}, mean reward {sum(rewards) / max(len(rewards), 1):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
