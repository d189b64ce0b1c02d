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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from tether import spans
from tether.config import TetherConfig
from tether.config.rollout import RemoteReward
from tether.logs import get_logger
from tether.scorers import REMOTE, SCORERS, math_reward, routes
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


# --- scorers ---------------------------------------------------------------------------------------
class LocalReward:
    def __init__(self, cfg: TetherConfig) -> None:
        self.cfg = cfg.rollout.reward

    async def score(self, items: Sequence[ScoreItem]) -> Scores:
        return [self._one(it) for it in items]

    def _one(self, it: ScoreItem) -> tuple[float, dict[str, float]]:
        c = self.cfg
        if c.type == "demo":
            return SCORERS["demo"](it.completion, it.reward_context)
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

    def __init__(self, cfg: TetherConfig, rc: RemoteReward | None = None) -> None:
        rc = rc or cfg.rollout.reward
        assert isinstance(rc, RemoteReward)
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
                with spans.span("reward_call", address=self.rc.address, items=len(items)):
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


class SourceReward:
    """Each completion scored by the scorer its ``data_source`` routes to; the remote ones in one call."""

    def __init__(self, cfg: TetherConfig) -> None:
        rc = cfg.rollout.reward
        self.routes = routes(rc.scorers)  # type: ignore[union-attr]
        self.remote = RemoteRewardClient(cfg, rc.remote) if rc.remote is not None else None  # type: ignore[union-attr]

    def _route(self, it: ScoreItem) -> str:
        source = it.reward_context.get("data_source")
        if source is None:
            raise RewardError("reward_context has no 'data_source' (rollout.reward.type: data_source)")
        if source not in self.routes:  # the learner checks its datasets at start; a custom prompt may not
            raise RewardError(f"no scorer for data_source {source!r} (rollout.reward.scorers)")
        return self.routes[source]

    async def score(self, items: Sequence[ScoreItem]) -> Scores:
        names = [self._route(it) for it in items]
        out: Scores = [(0.0, {})] * len(items)
        remote = [i for i, name in enumerate(names) if name == REMOTE]
        if remote:
            assert self.remote is not None  # the config refuses a remote route without rollout.reward.remote
            for i, scored in zip(remote, await self.remote.score([items[i] for i in remote]), strict=True):
                out[i] = scored
        for i, name in enumerate(names):
            if name != REMOTE:
                try:
                    out[i] = SCORERS[name](items[i].completion, items[i].reward_context)
                except KeyError as e:
                    raise RewardError(f"scorer {name!r}: {e.args[0]}") from None
        return out

    async def close(self) -> None:
        if self.remote is not None:
            await self.remote.close()


def build_reward(cfg: TetherConfig) -> LocalReward | RemoteRewardClient | SourceReward:
    kind = cfg.rollout.reward.type
    if kind == "data_source":
        return SourceReward(cfg)
    return RemoteRewardClient(cfg) if kind == "remote" else LocalReward(cfg)
