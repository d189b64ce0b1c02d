"""Built-in tasks: the demo task a tiny model learns on CPU in minutes, and its reward.

``learner.data_path: demo:charclass`` streams prompts such as ``"digits:"``; the reward
(``rollout.reward.type: demo``) is the fraction of completion characters that belong to the class the
prompt names, so a random byte-level model starts near 0.05 and a policy that learned the mapping from
prompt to class scores close to 1. The signal is dense (every token counts) and prompt-dependent (the
model must read the prompt), which is what makes it learnable by a tiny model in a few hundred steps.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Mapping

CHAR_CLASSES: dict[str, str] = {
    "digits": string.digits,
    "lower": string.ascii_lowercase,
    "upper": string.ascii_uppercase,
}

DEMO_TASKS = ("charclass",)


def demo_rows(task: str = "charclass", *, seed: int = 0) -> Iterator[dict[str, str]]:
    """An endless, seeded stream of ``{"prompt": ..., "answer": ...}`` rows of a built-in task."""
    if task not in DEMO_TASKS:
        raise ValueError(f"unknown demo task {task!r}; known: {', '.join(DEMO_TASKS)}")
    rng = random.Random(seed)
    names = sorted(CHAR_CLASSES)
    while True:
        name = rng.choice(names)
        yield {"prompt": f"{name}:", "answer": name}


def demo_reward(completion: str, reward_context: Mapping[str, str]) -> float:
    """Fraction of the completion's characters in the class named by ``reward_context["answer"]``."""
    allowed = CHAR_CLASSES.get(reward_context.get("answer", ""))
    if allowed is None or not completion:
        return 0.0
    return sum(ch in allowed for ch in completion) / len(completion)
