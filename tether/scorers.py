"""Rule-based scorers by name, and which one a row's ``data_source`` gets.

A scorer is a pure function ``(completion, reward_context) -> (reward, components)``; the reference
answer is ``reward_context["answer"]`` (the learner puts the dataset's answer column there, verl's
``reward_model.ground_truth`` included). Built-ins:

- ``gsm8k``: the number after the last ``####`` in the completion (verl's strict GSM8K rule), compared
  numerically with the reference — commas, a ``$``, a unit word and a trailing period do not matter;
- ``math``: the last ``\\boxed{...}`` (verl's MATH rule: no box, no credit), exact match after
  normalising LaTeX (``\\frac``/``\\dfrac``, ``\\left``, ``\\text{}``, degrees, ``\\%``, spaces), and
  numerically equal values count as equal;
- ``math_any``: the same, falling back to the last number when there is no box (``rollout.reward.type: math``);
- ``exact_match``: the stripped completion equals the answer;
- ``demo``: the built-in tasks of :mod:`tether.tasks`.

:data:`DEFAULT_SOURCES` routes the data sources verl's own reward routing knows (``openai/gsm8k``,
``lighteval/MATH``, …) and the demo tasks; ``rollout.reward.scorers`` adds or overrides routes, and a
route may say ``remote`` (the configured reward service). This module is imported by the config, the
learner (to check at start that every data source has a scorer) and rollout servers (to score).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from fractions import Fraction

from tether.tasks import demo_reward

Scored = tuple[float, dict[str, float]]
Scorer = Callable[[str, Mapping[str, str]], Scored]

REMOTE = "remote"
"""A route to the reward service of ``rollout.reward.remote`` instead of a built-in scorer."""


# --- math answers ----------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None when absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)")  # \frac12 is \frac{1}{2}
_DEGREES = re.compile(r"\^\{?\\circ\}?")


def normalize_answer(text: str) -> str:
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = _DEGREES.sub("", s)
    for junk in ("\\!", "\\,", "\\;", "\\left", "\\right", "\\%", "\\$", " "):
        s = s.replace(junk, "")
    s = s.rstrip(".")
    # Thousands separators: "1,000,000" but not a tuple like "1,2".
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def to_number(text: str) -> Fraction | None:
    s = normalize_answer(text)
    sign = 1
    if s.startswith("-("):  # "-\\frac{3}{4}" normalizes to "-(3)/(4)"
        sign, s = -1, s[1:]
    m = re.fullmatch(r"\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", s)
    try:
        if m:
            den = Fraction(m.group(2))
            return sign * Fraction(m.group(1)) / den if den else None
        return sign * Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(given: str, reference: str) -> bool:
    a, b = to_number(given), to_number(reference)
    if a is not None and b is not None:
        return a == b
    return normalize_answer(given) == normalize_answer(reference)


def math_reward(completion: str, reference: str, *, format_bonus: float = 0.0, boxed_only: bool = False) -> Scored:
    """1.0 when the last ``\\boxed{}`` (else, unless ``boxed_only``, the last number) equals ``reference``;
    ``format_bonus`` for a box that is wrong."""
    boxed = last_boxed(completion)
    if boxed is None and not boxed_only:
        numbers = _NUMBER.findall(completion)
        answer = numbers[-1] if numbers else None
    else:
        answer = boxed
    correct = answer is not None and math_equal(answer, reference)
    reward = 1.0 if correct else (format_bonus if boxed is not None else 0.0)
    return reward, {"correct": float(correct), "boxed": float(boxed is not None)}


# --- GSM8K -----------------------------------------------------------------------------------------
_GSM8K_FINAL = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` (commas dropped, a trailing period ignored); None when absent."""
    found = _GSM8K_FINAL.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_reward(completion: str, reference: str) -> Scored:
    # A reference may be a whole GSM8K solution ("... #### 72") or just the number.
    ref = gsm8k_answer(reference) or reference.strip()
    given = gsm8k_answer(completion)
    correct = given is not None and math_equal(given, ref)
    return float(correct), {"correct": float(correct), "formatted": float(given is not None)}


# --- the registry ----------------------------------------------------------------------------------
def _answer(ctx: Mapping[str, str]) -> str:
    answer = ctx.get("answer")
    if answer is None:
        raise KeyError(f"reward_context has no 'answer' (keys: {sorted(ctx)})")
    return answer


SCORERS: dict[str, Scorer] = {
    "gsm8k": lambda completion, ctx: gsm8k_reward(completion, _answer(ctx)),
    "math": lambda completion, ctx: math_reward(completion, _answer(ctx), boxed_only=True),
    "math_any": lambda completion, ctx: math_reward(completion, _answer(ctx)),
    "exact_match": lambda completion, ctx: (float(completion.strip() == _answer(ctx).strip()), {}),
    "demo": lambda completion, ctx: _demo(completion, ctx),
}


def _demo(completion: str, ctx: Mapping[str, str]) -> Scored:
    """The built-in tasks' reward: the real-model task is scored by the ``math`` rule, the others by theirs."""
    if ctx.get("task") == "fewshot_addition":
        return math_reward(completion, _answer(ctx), boxed_only=True)
    return demo_reward(completion, ctx), {}


DEFAULT_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "charclass": "demo",
    "addition": "demo",
    "fewshot_addition": "math",
    "longtail": "demo",
}
"""verl's ``default_compute_score`` names, plain ``gsm8k``/``math``, and the demo tasks."""


def routes(overrides: Mapping[str, str]) -> dict[str, str]:
    """Data source -> scorer name: :data:`DEFAULT_SOURCES` updated with ``rollout.reward.scorers``."""
    return {**DEFAULT_SOURCES, **overrides}


def unrouted(sources: set[str], overrides: Mapping[str, str]) -> list[str]:
    """The data sources that no route names, sorted (empty when every source has a scorer)."""
    table = routes(overrides)
    return sorted(s for s in sources if s not in table)
