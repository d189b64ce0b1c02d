"""Multi-turn episodes for custom environments: open, alternate observations and model turns, close.

The server, not the environment, keeps the token record — exactly the ids the model saw and sampled,
each with its behaviour log-prob, policy version and loss mask (environment tokens 0, model tokens 1)
— because re-tokenizing a transcript afterwards does not reproduce the sampled ids. With a chat prompt
an observation becomes a message through the tokenizer's chat template: the template is rendered with
and without the new message and the difference (plus whatever the template puts after the model's
end-of-turn token, e.g. ChatML's newline) is appended as environment tokens. Only the opening prompt is
encoded as a prompt (:func:`tether.prompts.encode_prompt`: BOS where the tokenizer adds one); every
observation continues the sequence (:func:`tether.prompts.encode_continuation`), so no BOS lands
mid-episode. Episodes idle longer than ``episode_idle_timeout_s`` are dropped; later calls get NOT_FOUND.
Episodes sharing ``group_id`` are held until ``group_size`` have closed, then written as one group; a
group that never fills is dropped after twice the idle timeout and counted (``episode_groups_incomplete``
in the buffer stats).
Episodes are trained on, so they sample the full distribution (no top-p/top-k) and every trajectory
records its temperature (:data:`tether.trajectory.TEMPERATURE_KEY`) for the learner.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from rollout_server.engines.base import FINISH_STOP, Completion, SamplingSpec
from rollout_server.state import ServerState
from rollout_server.trajectories import build_trajectory
from rollout_server.validation import BadRequest, check_length, encode, render_messages, sampling_spec
from tether.logs import get_logger
from tether.prompts import encode_continuation, render_chat
from tether.trajectory import PROMPT_GROUP_PREFIX, GroupData, TrajectoryData
from tether.v1 import rollout_pb2, trajectory_pb2

log = get_logger(__name__)

EXPIRED = "episodes_expired"
"""The run's counter of episodes nobody closed (dead-lettered; ``tether status``)."""


@dataclass(frozen=True)
class Mark:
    """The record's lengths right after one model turn (``seen`` counts the client's view, reply included)."""

    seen: int
    tokens: int
    messages: int
    stopped: bool


@dataclass
class Episode:
    id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    messages: list[dict[str, str]] | None  # None for text episodes
    group_id: str
    group_size: int
    metadata: dict[str, str]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    last_turn_stopped: bool = False
    turns: int = 0
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas the chat template describes
    seen: list[Any] = field(default_factory=list)
    """The transcript as the HTTP client sees it (its messages and our replies, normalised), one entry per message."""
    marks: list[Mark] = field(default_factory=list)
    """Where the record stood after each model turn: the points an HTTP episode can branch from."""
    started_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _stopped_on(tok: Any, ep: Episode) -> str:
    """The text of the special token the model's last turn stopped on — ChatML's ``<|im_end|>``, Gemma's
    ``<end_of_turn>`` (a stop id of its generation config, not its ``eos_token``) — which the record already
    holds and the template writes again; "" when the turn ran out of tokens or ended on ordinary text."""
    if not (ep.last_turn_stopped and ep.tokens):
        return ""
    last = ep.tokens[-1:]
    if tok.decode(last, skip_special_tokens=True):  # an ordinary token: part of the message's content
        return ""
    return tok.decode(last, skip_special_tokens=False)


def chat_continuation(tok: Any, ep: Episode, new: list[dict[str, Any]]) -> list[int]:
    """The ids that continue a chat episode's record with ``new`` messages and the generation prompt of the
    model's next turn: the template is rendered with and without them and the difference is encoded as a
    continuation (the template's own ``<bos>`` sits in the part already recorded), after whatever the template
    writes behind the model's last content that the model did not sample itself (ChatML's newline after
    ``<|im_end|>``). ``new`` is appended to ``ep.messages``."""
    assert ep.messages is not None
    before = render_chat(tok, ep.messages, add_generation_prompt=False, tools=ep.tools)
    after = render_chat(tok, [*ep.messages, *new], tools=ep.tools)
    if not after.startswith(before):
        raise BadRequest("step: this chat template re-renders earlier turns; use a text episode instead")
    last = ep.messages[-1]["content"]
    tail = before[before.rfind(last) + len(last) :]
    stop = _stopped_on(tok, ep)
    if stop and tail.startswith(stop):
        tail = tail[len(stop) :]
    ep.messages.extend(new)
    return encode_continuation(tok, tail + after[len(before) :])


class EpisodeStore:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.timeout_s = state.cfg.rollout.episode_idle_timeout_s
        self._episodes: dict[str, Episode] = {}
        self._groups: dict[str, tuple[float, list[TrajectoryData]]] = {}

    def __len__(self) -> int:
        return len(self._episodes)

    def get(self, episode_id: str) -> Episode:
        """The live episode ``episode_id`` (NOT_FOUND when unknown, closed or idle past the timeout); a use of it."""
        ep = self._episodes.get(episode_id)
        if ep is not None and time.monotonic() - ep.last_used > self.timeout_s:
            ep = None  # the sweeper removes it, and dead-letters what it held
        if ep is None:
            raise BadRequest(
                f"episode {episode_id!r} not found: unknown, closed, or idle longer than "
                f"{self.timeout_s:g}s (rollout.episode_idle_timeout_s)",
                grpc.StatusCode.NOT_FOUND,
            )
        ep.last_used = time.monotonic()
        return ep

    async def open(self, req: rollout_pb2.OpenEpisodeRequest) -> rollout_pb2.OpenEpisodeResponse:
        s, e = self.state, self.state.engine
        if s.sink is None:
            raise BadRequest(
                "episodes need the buffer: start the server with run.run_id and buffer.redis_url set",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if s.draining:
            raise BadRequest("server is draining; open the episode on another server", grpc.StatusCode.UNAVAILABLE)
        kind = req.WhichOneof("prompt")
        messages = None
        if kind == "messages":
            messages = [{"role": m.role, "content": m.content} for m in req.messages.messages]
            ids = encode(e.tokenizer, render_messages(e.tokenizer, req.messages.messages))
        elif kind == "text" and req.text:
            ids = encode(e.tokenizer, req.text)
        else:
            raise BadRequest("prompt: empty — set text or messages")
        check_length(ids, s.cfg.rollout, max_model_len=e.max_model_len)
        spec = sampling_spec(req.sampling, s.cfg.rollout, n_override=1)
        if spec.top_p != 1.0 or spec.top_k > 0:
            key = "top_p" if spec.top_p != 1.0 else "top_k"
            raise BadRequest(
                f"sampling.{key}: episodes are trained on, so they sample the full temperature-scaled "
                "distribution the learner recomputes; leave top_p and top_k unset"
            )
        ep = self.create(uuid.uuid4().hex, ids, spec, messages, req.group_id, req.group_size, dict(req.metadata))
        return rollout_pb2.OpenEpisodeResponse(
            episode_id=ep.id, prompt_token_ids=ids, expires_in_ms=int(self.timeout_s * 1000)
        )

    def create(
        self,
        eid: str,
        ids: list[int],
        spec: SamplingSpec,
        messages: list[dict[str, Any]] | None,
        group_id: str,
        group_size: int,
        metadata: dict[str, str],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> Episode:
        """A new episode under ``eid`` whose record starts with the prompt ``ids`` (checked by the caller)."""
        if group_id.startswith(PROMPT_GROUP_PREFIX):
            raise BadRequest(f"group_id: the prefix {PROMPT_GROUP_PREFIX!r} is reserved for prompts-stream groups")
        ep = Episode(eid, ids, spec, messages, group_id or f"episode-{eid}", max(1, group_size), metadata, tools=tools)
        self._episodes[eid] = ep
        return ep

    def lookup(self, episode_id: str) -> Episode | None:
        """The live episode ``episode_id``, or None (never opened, closed, or idle past the timeout)."""
        try:
            return self.get(episode_id)
        except BadRequest:
            return None

    def discard(self, episode_id: str) -> None:
        self._episodes.pop(episode_id, None)

    @staticmethod
    def rewind(ep: Episode, mark: Mark) -> None:
        """Cut the record back to where it stood at ``mark`` (what came after is dropped by the caller's count)."""
        n = mark.tokens
        del ep.tokens[n:], ep.logprobs[n:], ep.versions[n:], ep.mask[n:], ep.seen[mark.seen :]
        if ep.messages is not None:
            del ep.messages[mark.messages :]
        ep.marks = [m for m in ep.marks if m.tokens <= n]
        ep.turns = len(ep.marks)
        ep.last_turn_stopped = mark.stopped

    def _observation_ids(self, ep: Episode, req: rollout_pb2.StepRequest) -> list[int]:
        tok = self.state.engine.tokenizer
        if ep.messages is None:
            return encode_continuation(tok, req.observation)
        if not ep.turns:
            raise BadRequest(
                "step: a chat episode's first Step takes no observation (the opening messages are the "
                "first turn); send it empty"
            )
        message = {"role": req.observation_role or "user", "content": req.observation}
        if message["role"] not in {"user", "tool", "system"}:
            raise BadRequest(f"step.observation_role: {message['role']!r} is not one of user, tool, system")
        return chat_continuation(tok, ep, [message])

    async def step(self, req: rollout_pb2.StepRequest) -> rollout_pb2.StepResponse:
        ep = self.get(req.episode_id)
        async with ep.lock:
            if req.observation:
                self.observe(ep, self._observation_ids(ep, req))
            context, spec = self.next_turn(ep, ep.spec)
            (sample,) = await self.state.engine.generate(context, spec)
            self.record(ep, sample)
            return rollout_pb2.StepResponse(
                text=sample.text,
                token_ids=sample.token_ids,
                logprobs=sample.logprobs,
                policy_versions=sample.versions,
                finish_reason=sample.finish_reason,  # type: ignore[arg-type]
                total_tokens=len(ep.prompt_ids) + len(ep.tokens),
            )

    def observe(self, ep: Episode, ids: list[int]) -> None:
        """Append environment tokens (not trained on: mask 0, log-prob 0, the engine's current version)."""
        ep.tokens += ids
        ep.logprobs += [0.0] * len(ids)
        ep.versions += [self.state.engine.policy_version] * len(ids)
        ep.mask += [0] * len(ids)

    def next_turn(self, ep: Episode, spec: SamplingSpec) -> tuple[list[int], SamplingSpec]:
        """The context of the model's next turn and ``spec`` cut to the room left in the model's context."""
        context = ep.prompt_ids + ep.tokens
        room = self.state.engine.max_model_len - len(context)
        if room <= 0:
            raise BadRequest(
                f"episode {ep.id}: {len(context)} tokens fill the model's context "
                f"({self.state.engine.max_model_len}); close it",
                grpc.StatusCode.OUT_OF_RANGE,
            )
        return context, spec if room >= spec.max_tokens else replace(spec, max_tokens=room)

    def record(self, ep: Episode, sample: Completion, *, content: str | None = None) -> None:
        """Append the model's turn exactly as sampled; ``content`` is the assistant message the chat template
        sees for it (its decoded text by default)."""
        ep.tokens += sample.token_ids
        ep.logprobs += sample.logprobs
        ep.versions += sample.versions
        ep.mask += [1] * len(sample.token_ids)
        ep.turns += 1
        ep.last_turn_stopped = sample.finish_reason == FINISH_STOP
        if ep.messages is not None:
            ep.messages.append({"role": "assistant", "content": sample.text if content is None else content})
        ep.last_used = time.monotonic()
        self.state.metrics.add_tokens(len(sample.token_ids))

    async def close(self, req: rollout_pb2.CloseEpisodeRequest) -> rollout_pb2.CloseEpisodeResponse:
        # A NaN or infinite reward would poison every advantage of its group in the learner; refuse it
        # before anything changes, so the environment can retry the close with a finite one.
        for name, value in [
            ("reward", req.reward),
            *((f"reward_components[{k!r}]", v) for k, v in req.reward_components.items()),
        ]:
            if not math.isfinite(value):
                raise BadRequest(f"close: {name} is {value}; rewards must be finite")
        ep = self.get(req.episode_id)
        async with ep.lock:
            if not any(ep.mask):
                raise BadRequest(
                    f"episode {ep.id}: no model turn yet; call Step before CloseEpisode",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            self._episodes.pop(ep.id, None)
        traj = build_trajectory(
            trajectory_id=f"{ep.group_id}-{ep.id}",
            group_id=ep.group_id,
            prompt_ids=ep.prompt_ids,
            token_ids=ep.tokens,
            logprobs=ep.logprobs,
            versions=ep.versions,
            loss_mask=ep.mask,
            finish_reason=trajectory_pb2.FINISH_REASON_ENV_CLOSED,
            server_id=self.state.server_id,
            logprob_source=self.state.engine.logprob_source,
            temperature=ep.spec.temperature,
            started_at=ep.started_at,
            reward=req.reward,
            reward_components=req.reward_components,
            metadata={**ep.metadata, **req.metadata, "episode_id": ep.id, "turns": str(ep.turns)},
        )
        _, members = self._groups.setdefault(ep.group_id, (time.monotonic(), []))
        members.append(traj)
        written = False
        if len(members) >= ep.group_size:
            self._groups.pop(ep.group_id, None)
            group = GroupData(group_id=ep.group_id, trajectories=members, metadata={"source": "episode"})
            assert self.state.sink is not None
            await self.state.sink.put(group)
            self.state.metrics.groups.labels("episode").inc()
            written = True
        return rollout_pb2.CloseEpisodeResponse(
            trajectory_id=traj.id, group_id=ep.group_id, num_completion_tokens=len(ep.tokens), group_written=written
        )

    async def sweep_forever(self) -> None:
        """Drop idle episodes and groups that never filled (their closed members are logged and lost)."""
        period = min(5.0, max(0.1, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for eid in [k for k, ep in self._episodes.items() if now - ep.last_used > self.timeout_s]:
                ep = self._episodes.pop(eid, None)
                if ep is not None:
                    await self._expired(ep)
            for gid in [g for g, (t, _) in self._groups.items() if now - t > 2 * self.timeout_s]:
                _, members = self._groups.pop(gid)
                log.warning("episode_group_incomplete", group_id=gid, closed=len(members))
                if self.state.sink is not None:
                    try:
                        await self.state.sink.count("episode_groups_incomplete")
                    except Exception as e:  # Redis away: the log line above still says it
                        log.warning("episode_group_incomplete_not_counted", group_id=gid, error=str(e))

    async def _expired(self, ep: Episode) -> None:
        """An episode nobody closed: logged, and one with a model turn dead-lettered with the reason (its record
        as JSON ids, so an operator can see what was lost; it is never trained on without a reward)."""
        log.info("episode_expired", episode_id=ep.id, turns=ep.turns)
        if not ep.turns or self.state.sink is None:
            return
        limit = f"{self.timeout_s:g}s (rollout.episode_idle_timeout_s)"
        reason = f"episode {ep.id} ({ep.group_id}): not closed within {limit}"
        record = {"episode_id": ep.id, "group_id": ep.group_id, "turns": ep.turns, "prompt_token_ids": ep.prompt_ids,
                  "token_ids": ep.tokens, "loss_mask": ep.mask, "metadata": ep.metadata}  # fmt: skip
        try:
            await self.state.sink.dead_letter(reason=reason, data=json.dumps(record).encode(), counter=EXPIRED)
        except Exception as e:  # Redis away: the log line above still says it
            log.warning("episode_expired_not_dead_lettered", episode_id=ep.id, error=str(e))
