"""The prompt worker: prompts stream -> G samples -> rewards -> one group in the trajectories stream.

``rollout.prompt_workers`` coroutines each hold one prompt at a time; they share the engine, whose
batching window merges their groups into one batch. The group id is derived from the prompts-stream
entry id, so when a prompt is redelivered (this server died after writing but before acking, or
another server reclaimed it) the buffer's idempotent put drops the duplicate. A prompt is
acknowledged only after its group is in the buffer or dead-lettered; samples that ended aborted
(partial tokens: a failed batch, a drain) are not scored — they keep reward 0, are counted
(``tether_rollout_aborted_samples``) and the learner skips them; a prompt whose work is cut off
by a drain stays unacknowledged and is reclaimed by another server. While the engine is paused
(weight update) no new prompt is taken, so nothing sits read-but-idle across an update.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis

from rollout_server.engines.base import SamplingSpec
from rollout_server.evaluator import Evaluator
from rollout_server.rewards import RewardError, ScoreItem, build_reward
from rollout_server.shares import Turn
from rollout_server.state import ServerState
from rollout_server.trajectories import build_trajectory
from rollout_server.validation import BadRequest, check_length, check_vocab, encode
from tether import spans
from tether.logs import get_logger
from tether.resources import prompt_workers
from tether.trajectory import PROMPT_GROUP_PREFIX, GroupData
from tether.v1 import trajectory_pb2

log = get_logger(__name__)


class PromptWorker:
    def __init__(self, state: ServerState) -> None:
        assert state.sink is not None
        self.state = state
        self.sink = state.sink
        self.reward = build_reward(state.cfg)
        self.evaluator = Evaluator(state, self.reward)  # held-out prompts, taken before training prompts
        self.groups_done = 0
        self.redis_errors = 0  # prompts abandoned to a Redis outage (each logged; the prompt is reclaimed)
        if state.share_gate is not None:  # a paused engine (weight update) holds none of the fleet's slots
            state.share_gate.watch(state.cfg.run.run_id or "", lambda: state.engine.paused)

    async def run(self) -> None:
        """Run the worker coroutines until the server drains; returns when all have finished."""
        n = prompt_workers(self.state.cfg)
        try:
            await asyncio.gather(*(self._loop(i) for i in range(n)))
        finally:
            await self.reward.close()

    async def _loop(self, index: int) -> None:
        s = self.state
        spans.set_track(f"worker-{index}")  # each coroutine its own track: its spans nest, never interleave
        while not s.draining:
            if s.engine.paused:  # a weight update: take the next prompt the moment it ends
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(s.engine.wait_resumed(), timeout=0.5)  # bounded: a drain may begin
                continue
            if await self.evaluator.step():
                continue
            try:
                entries = await self.sink.read_prompts(count=1, block_ms=500)
            except Exception as e:  # Redis down or a stream reset: keep the server up, try again
                log.warning("prompt_read_failed", worker=index, error=str(e))
                await asyncio.sleep(1.0)
                continue
            for entry_id, prompt in entries:  # taken before a drain began: still finish it
                try:
                    await self._process(entry_id, prompt)
                except redis.RedisError as e:
                    # Redis went away mid-prompt for longer than the client's retries. The prompt is
                    # still pending in the prompts stream and is reclaimed after claim_idle_ms (by this
                    # server or another); its group id is derived from the entry id, so a group that
                    # did get written is not duplicated. Keep the worker, not the prompt.
                    self.redis_errors += 1
                    log.warning("prompt_failed_redis", worker=index, entry_id=entry_id, errors=self.redis_errors,
                                error=str(e))  # fmt: skip
                    await asyncio.sleep(1.0)

    async def _process(self, entry_id: str, prompt: trajectory_pb2.Prompt) -> None:
        s, e, rc = self.state, self.state.engine, self.state.cfg.rollout
        group_id = f"{PROMPT_GROUP_PREFIX}{entry_id}"
        try:
            ids = self._prompt_ids(prompt)
        except BadRequest as err:
            await self._dead_letter(entry_id, group_id, f"bad prompt: {err}", prompt.SerializeToString())
            return
        spec = SamplingSpec(
            n=rc.n,
            temperature=rc.temperature,
            top_p=rc.top_p,
            top_k=rc.top_k,
            max_tokens=prompt.max_tokens or rc.max_tokens,
            stop=tuple(rc.stop),
        )
        started = time.time()
        with spans.span("generate", group=group_id, n=spec.n):
            async with self._turn() as turn:  # a fleet of several runs: this run's share of the generation
                samples = await e.generate(ids, spec, request_id=f"{group_id}-{time.monotonic_ns()}")
                generated = sum(len(x.token_ids) for x in samples)
                if turn is not None:
                    turn.spend(generated)
        s.metrics.add_tokens(generated)
        items = [
            ScoreItem(prompt.text, x.text, ids, x.token_ids, prompt.reward_context, f"{group_id}-{i}")
            for i, x in enumerate(samples)
        ]
        group = self._group(entry_id, prompt, ids, samples, items=items, spec=spec, started=started)
        scores, failure = await self._score(group_id, items, samples)
        if scores is None:
            from buffer.codec import encode_payload

            payload = encode_payload(group)[1]  # the columnar group, the one codec a group is written in
            await self._dead_letter(entry_id, group_id, f"reward failed: {failure}", payload)
            return
        for t, (reward, components) in zip(group.trajectories, scores, strict=True):
            t.reward, t.reward_components = float(reward), components
        await self._put(entry_id, group)

    def _prompt_ids(self, prompt: trajectory_pb2.Prompt) -> list[int]:
        """The prompt's token ids (its own, or its text encoded), checked as the Generate RPC checks them;
        BadRequest when they or its ``max_tokens`` cannot be served."""
        s, e, rc = self.state, self.state.engine, self.state.cfg.rollout
        ids = list(prompt.token_ids) or encode(e.tokenizer, prompt.text)
        if prompt.token_ids:  # as the Generate RPC checks them: an id outside the vocabulary fails the batch
            check_vocab(ids, vocab_size=s.vocab_size())
        check_length(ids, rc, max_model_len=e.max_model_len)
        if not 0 <= prompt.max_tokens <= rc.max_tokens:
            raise BadRequest(f"max_tokens {prompt.max_tokens} is outside 0..{rc.max_tokens} (rollout.max_tokens)")
        return ids

    def _group(
        self,
        entry_id: str,
        prompt: trajectory_pb2.Prompt,
        ids: list[int],
        samples: list,
        *,
        items: list[ScoreItem],
        spec: SamplingSpec,
        started: float,
    ) -> GroupData:
        """The prompt's group: one trajectory per sample (rewards not yet set)."""
        s, e = self.state, self.state.engine
        group_id = f"{PROMPT_GROUP_PREFIX}{entry_id}"
        trajectories = [
            build_trajectory(
                trajectory_id=items[i].trajectory_id,
                group_id=group_id,
                prompt_ids=ids,
                token_ids=x.token_ids,
                logprobs=x.logprobs,
                versions=x.versions,
                finish_reason=x.finish_reason,
                server_id=s.server_id,
                logprob_source=e.logprob_source,
                temperature=spec.temperature,
                started_at=started,
            )
            for i, x in enumerate(samples)
        ]
        return GroupData(
            group_id,
            trajectories,
            prompt_id=prompt.prompt_id or entry_id,
            metadata={"dataset_index": str(prompt.dataset_index), "issued_at_version": str(prompt.issued_at_version)},
        )

    async def _score(self, group_id: str, items: list[ScoreItem], samples: list) -> tuple[list | None, str]:
        """(reward, components) per sample, trying ``rollout.reward_attempts`` times; (None, the last error)
        when every attempt failed. Aborted samples hold partial tokens: never scored (a reward of a cut-off
        answer means nothing), they keep (0.0, {})."""
        s = self.state
        scored = [i for i, x in enumerate(samples) if x.finish_reason != trajectory_pb2.FINISH_REASON_ABORTED]
        if len(scored) < len(samples):
            s.metrics.aborted_samples.inc(len(samples) - len(scored))
        failure = ""
        for attempt in range(s.cfg.rollout.reward_attempts):
            try:
                with spans.span("reward", group=group_id, attempt=attempt + 1):
                    got = await self.reward.score([items[i] for i in scored]) if scored else []
                scores: list = [(0.0, {}) for _ in samples]
                for i, score in zip(scored, got, strict=True):
                    scores[i] = score
                return scores, ""
            except RewardError as err:
                failure = str(err)
                s.metrics.reward_failures.inc()
                log.warning("reward_failed", group_id=group_id, attempt=attempt + 1, error=failure)
                await asyncio.sleep(min(2.0, 0.2 * 2**attempt))
        return None, failure

    def _turn(self) -> contextlib.AbstractAsyncContextManager[Turn | None]:
        """The generation's turn at the fleet's fair-share gate: only the generation waits for it (scoring
        and a put waiting for room never hold a turn another run could use). A server of one run: at once."""
        gate = self.state.share_gate
        if gate is None:
            return contextlib.nullcontext(None)
        return gate.turn(self.state.cfg.run.run_id or "")

    async def _put(self, entry_id: str, group: GroupData) -> None:
        from buffer import BufferFull

        while True:
            try:
                with spans.span("buffer_put", group=group.group_id):
                    fresh = await self.sink.put(group)
                break
            except BufferFull as err:  # the learner is behind: wait, unless we are shutting down
                if self.state.draining:
                    log.info("prompt_returned_unacked", entry_id=entry_id, reason=str(err))
                    return
                log.warning("buffer_full", group_id=group.group_id, error=str(err))
        await self.sink.ack([entry_id])
        self.groups_done += 1
        self.state.metrics.groups.labels("prompts").inc()
        if not fresh:
            log.info("group_duplicate", group_id=group.group_id)

    async def _dead_letter(self, entry_id: str, group_id: str, reason: str, data: bytes) -> None:
        log.error("group_dead_lettered", group_id=group_id, reason=reason)
        await self.sink.dead_letter(reason=f"{group_id}: {reason}", data=data)
        self.state.metrics.dead_lettered.inc()
        await self.sink.ack([entry_id])
