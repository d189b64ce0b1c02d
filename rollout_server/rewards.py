"""Reward functions of the prompts stream: built-ins selected by ``rollout.reward.type``, or a remote service.

Every scorer has one async shape, ``score(items) -> [(reward, components)]`` over a whole group, so
the prompt worker is the same for a regex and for a user's gRPC service. Built-ins are pure and
cheap (run inline). The remote client sets a deadline on every call and retries only on
UNAVAILABLE / DEADLINE_EXCEEDED (what the Reward service contract calls safe to retry); any other
failure, or retries running out, raises :class:`RewardError`, which the worker turns into a group
retry and then a dead letter — a broken reward service never crashes the server.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import grpc

from tether.config import TetherConfig
from tether.logs import get_logger
from tether.tasks import demo_reward
from tether.v1 import reward_pb2, reward_pb2_grpc

log = get_logger(__name__)


class RewardError(RuntimeError):
    """Scoring failed (the reward service is down, too slow, or answered wrongly)."""


@dataclass
class ScoreItem:
    prompt: str
    completion: str
    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]
    reward_context: Mapping[str, str]
    trajectory_id: str


Scores = list[tuple[float, dict[str, float]]]


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


def normalize_answer(text: str) -> str:
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    for junk in ("\\!", "\\,", "\\;", "\\left", "\\right", " "):
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


def math_reward(completion: str, reference: str, *, format_bonus: float = 0.0) -> tuple[float, dict[str, float]]:
    boxed = last_boxed(completion)
    if boxed is None:
        numbers = _NUMBER.findall(completion)
        answer = numbers[-1] if numbers else None
    else:
        answer = boxed
    correct = answer is not None and math_equal(answer, reference)
    reward = 1.0 if correct else (format_bonus if boxed is not None else 0.0)
    return reward, {"correct": float(correct), "boxed": float(boxed is not None)}


# --- scorers ---------------------------------------------------------------------------------------
class LocalReward:
    def __init__(self, cfg: TetherConfig) -> None:
        self.cfg = cfg.rollout.reward

    async def score(self, items: Sequence[ScoreItem]) -> Scores:
        return [self._one(it) for it in items]

    def _one(self, it: ScoreItem) -> tuple[float, dict[str, float]]:
        c = self.cfg
        if c.type == "demo":
            return demo_reward(it.completion, it.reward_context), {}
        reference = it.reward_context.get(c.answer_key)  # type: ignore[union-attr]
        if reference is None:
            raise RewardError(f"reward_context has no {c.answer_key!r} (rollout.reward.answer_key)")  # type: ignore[union-attr]
        if c.type == "exact_match":
            return float(it.completion.strip() == reference.strip()), {}
        return math_reward(it.completion, reference, format_bonus=c.format_bonus)  # type: ignore[union-attr]

    async def close(self) -> None:
        pass


class RemoteRewardClient:
    """Client of a user's ``tether.v1.Reward`` service; one ScoreBatch call per group."""

    RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    def __init__(self, cfg: TetherConfig) -> None:
        rc = cfg.rollout.reward
        assert rc.type == "remote"
        self.rc = rc
        size = cfg.rollout.max_message_bytes
        opts = [
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            # gRPC's reconnect backoff grows to 120 s while a service is down, and until the next attempt
            # every call fails at once with UNAVAILABLE; cap it so a service that comes back is used again
            # within seconds instead of dead-lettering groups for minutes.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self.channel = grpc.aio.insecure_channel(rc.address, options=opts)
        self.stub = reward_pb2_grpc.RewardStub(self.channel)
        self.metadata = (("authorization", f"Bearer {rc.token}"),) if rc.token else None

    async def score(self, items: Sequence[ScoreItem]) -> Scores:
        request = reward_pb2.ScoreBatchRequest(
            requests=[
                reward_pb2.ScoreRequest(
                    prompt=it.prompt,
                    completion=it.completion,
                    prompt_token_ids=it.prompt_token_ids,
                    completion_token_ids=it.completion_token_ids,
                    reward_context=dict(it.reward_context),
                    trajectory_id=it.trajectory_id,
                )
                for it in items
            ]
        )
        delay = 0.1
        for attempt in range(self.rc.max_retries + 1):
            try:
                reply = await self.stub.ScoreBatch(request, timeout=self.rc.timeout_s, metadata=self.metadata)
            except grpc.aio.AioRpcError as e:
                if e.code() not in self.RETRYABLE or attempt == self.rc.max_retries:
                    raise RewardError(f"reward service {self.rc.address}: {e.code().name}: {e.details()}") from None
                log.warning("reward_retry", address=self.rc.address, code=e.code().name, attempt=attempt + 1)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            if len(reply.responses) != len(items):
                raise RewardError(
                    f"reward service {self.rc.address}: {len(reply.responses)} scores for {len(items)} completions"
                )
            return [(r.reward, dict(r.components)) for r in reply.responses]
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.channel.close()


def build_reward(cfg: TetherConfig) -> LocalReward | RemoteRewardClient:
    return RemoteRewardClient(cfg) if cfg.rollout.reward.type == "remote" else LocalReward(cfg)
