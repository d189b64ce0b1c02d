"""Built-in tasks a tiny model can learn on CPU, and their rewards.

``demo:charclass`` streams prompts such as ``"digits:"``; its reward is the fraction of completion
characters in the class the prompt names, so a random byte-level model starts near 0.05 and a policy
that learned the mapping scores close to 1. It is learned from random weights in minutes: it shows the
loop works, not whether RL (or asynchrony) helps a model that already knows something.

``demo:addition`` is that second kind of task: prompts such as ``"47+08="`` with an exact-match reward
on the sum, ``"055"``. Operands and sum have a fixed width (zero-padded), so digits line up by position:
that is what lets a 2-layer byte-level model learn it in minutes on a CPU. A random model scores ~0, so
it needs a supervised warm start (``tether make-tiny-model DIR --warm-start addition``) that leaves it
partly right; RL then has to raise held-out accuracy. The pairs are split by a hash of the pair, so the
held-out (``split="val"``) prompts never occur in training — ``val_data_path: demo:addition`` evaluates
on that split.

``demo:fewshot_addition`` is the real-model task (``configs/gemma-addition.yaml``, ``make demo-real``):
four solved examples then ``"Q: What is 4 + 7?\\nA:"``, answered ``" \\boxed{11}"`` and scored by the
``math`` rule (the last box, verl's MATH convention). A pretrained base model half knows it — Gemma 3
270M at temperature 1 is right on ~0.11 of its samples — so RL has something to sharpen rather than to
teach from nothing. About a fifth of the 100 operand pairs (17, fixed by a hash) is held out: never a
question, never a shot.

``demo:longtail`` is charclass with long-tailed completion lengths, the workload that shows whether a
staleness bound skews what is trained toward short answers (docs/STALENESS.md): each prompt carries a
``max_tokens`` drawn from a Pareto tail (:func:`longtail_max_tokens`: from 4 tokens, median 8, one in
sixteen 64 or more, capped at 256), and a random byte-level model rarely ends early, so its completion
lengths follow that tail. The reward is charclass's, which does not depend on length.

Each row carries ``task`` in its reward context so one reward (``rollout.reward.type: demo``, or
``data_source`` routing by ``task``) scores every built-in task.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Iterator, Mapping

CHAR_CLASSES: dict[str, str] = {
    "digits": string.digits,
    "lower": string.ascii_lowercase,
    "upper": string.ascii_uppercase,
}

DEMO_TASKS = ("charclass", "addition", "fewshot_addition", "longtail")
SPLITS = ("train", "val")

ADDITION_DIGITS = 2
"""Digits of each operand (zero-padded); the sum has one more."""
ADDITION_VAL_PERCENT = 10
"""Percent of operand pairs held out for evaluation (chosen by a hash of the pair)."""


def addition_split(a: int, b: int) -> str:
    """``"val"`` for the held-out pairs, else ``"train"``: a fixed hash, so every process agrees."""
    h = int.from_bytes(hashlib.blake2b(f"{a}+{b}".encode(), digest_size=4).digest(), "big")
    return "val" if h % 100 < ADDITION_VAL_PERCENT else "train"


def addition_rows(*, seed: int = 0, split: str = "train") -> Iterator[dict[str, str]]:
    rng = random.Random(f"addition-{split}-{seed}")
    while True:
        a, b = rng.randrange(10**ADDITION_DIGITS), rng.randrange(10**ADDITION_DIGITS)
        if addition_split(a, b) == split:
            w = ADDITION_DIGITS
            yield {"prompt": f"{a:0{w}d}+{b:0{w}d}=", "answer": f"{a + b:0{w + 1}d}", "task": "addition"}


FEWSHOT_SHOTS = 4
"""Solved examples before the question of a ``fewshot_addition`` prompt."""
FEWSHOT_VAL_PERCENT = 20
"""Percent of single-digit operand pairs held out for evaluation (chosen by a hash of the pair)."""


def fewshot_split(a: int, b: int) -> str:
    """``"val"`` for the held-out single-digit pairs, else ``"train"`` (a fixed hash: every process agrees)."""
    h = int.from_bytes(hashlib.blake2b(f"fewshot {a}+{b}".encode(), digest_size=4).digest(), "big")
    return "val" if h % 100 < FEWSHOT_VAL_PERCENT else "train"


FEWSHOT_PAIRS = {
    split: [(a, b) for a in range(10) for b in range(10) if fewshot_split(a, b) == split] for split in SPLITS
}


def fewshot_addition_rows(*, seed: int = 0, split: str = "train") -> Iterator[dict[str, str]]:
    """Prompts of 4 solved examples then the question, ``"Q: What is a + b?\\nA:"``, answered
    ``" \\boxed{s}\\n"``; the shots always come from training pairs, so a held-out pair is never seen solved.
    The prompt ends on ``"A:"``, not ``"A: "``: a trailing space is a token the model never saw before a
    word in its training text (SentencePiece glues the space to the next word), and Gemma 3 270M's accuracy
    at temperature 1 falls from ~0.11 to ~0.01 with it. One line per answer: a rollout stop of ``"\\n"``
    ends it."""
    rng = random.Random(f"fewshot_addition-{split}-{seed}")
    shots_from, questions = FEWSHOT_PAIRS["train"], FEWSHOT_PAIRS[split]
    while True:
        a, b = rng.choice(questions)
        shots = "".join(
            f"{fewshot_question(x, y)} \\boxed{{{x + y}}}\n" for x, y in rng.sample(shots_from, FEWSHOT_SHOTS)
        )
        yield {"prompt": f"{shots}{fewshot_question(a, b)}", "answer": str(a + b), "task": "fewshot_addition"}


def fewshot_question(a: int, b: int) -> str:
    return f"Q: What is {a} + {b}?\nA:"


LONGTAIL_MIN_TOKENS, LONGTAIL_MAX_TOKENS = 4, 256


def longtail_max_tokens(rng: random.Random) -> int:
    """A Pareto (α = 1) length from :data:`LONGTAIL_MIN_TOKENS`: P(n ≥ x) = 4 / x, capped at 256."""
    return min(LONGTAIL_MAX_TOKENS, int(LONGTAIL_MIN_TOKENS / (1.0 - rng.random())))


def longtail_rows(*, seed: int = 0, split: str = "train") -> Iterator[dict[str, str]]:
    rng = random.Random(f"longtail-{split}-{seed}")
    names = sorted(CHAR_CLASSES)
    while True:
        name = rng.choice(names)
        yield {"prompt": f"{name}:", "answer": name, "task": "longtail", "max_tokens": str(longtail_max_tokens(rng))}


def demo_rows(task: str = "charclass", *, seed: int = 0, split: str = "train") -> Iterator[dict[str, str]]:
    """An endless, seeded stream of ``{"prompt": ..., "answer": ..., "task": ...}`` rows of a built-in
    task. ``split="val"`` gives the held-out rows (for charclass, the same distribution another seed)."""
    if task not in DEMO_TASKS:
        raise ValueError(f"unknown demo task {task!r}; known: {', '.join(DEMO_TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if task == "addition":
        yield from addition_rows(seed=seed, split=split)
        return
    if task == "fewshot_addition":
        yield from fewshot_addition_rows(seed=seed, split=split)
        return
    if task == "longtail":
        yield from longtail_rows(seed=seed, split=split)
        return
    rng = random.Random(seed if split == "train" else f"val-{seed}")
    names = sorted(CHAR_CLASSES)
    while True:
        name = rng.choice(names)
        yield {"prompt": f"{name}:", "answer": name, "task": "charclass"}


def charclass_reward(completion: str, answer: str) -> float:
    """Fraction of the completion's characters in the class named ``answer``."""
    allowed = CHAR_CLASSES.get(answer)
    if allowed is None or not completion:
        return 0.0
    return sum(ch in allowed for ch in completion) / len(completion)


def addition_reward(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the sum; else 0.0."""
    return float(bool(answer) and completion.strip() == answer)


def demo_reward(completion: str, reward_context: Mapping[str, str]) -> float:
    """The reward of the built-in task named by ``reward_context["task"]`` (charclass when absent)."""
    answer = reward_context.get("answer", "")
    if reward_context.get("task", "charclass") == "addition":
        return addition_reward(completion, answer)
    return charclass_reward(completion, answer)
