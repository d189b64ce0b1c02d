"""Evaluation prompts on a rollout server: sample, score, report — apart from everything trained on.

The prompt worker calls :meth:`Evaluator.step` before taking each training prompt, so evaluation goes
first and is not starved when the training prompts stream is full. A prompt asks for a policy version;
the server waits (briefly) until its weights are at least that version, so a round evaluates the weights
it was issued for — each result still carries the versions that actually made its tokens. Results go to
the validation results stream (:mod:`buffer.evaluation`): never to the trajectories stream, the training
counters or the buffer's books. A prompt that cannot be done (bad prompt, reward failure) is reported with
an error, which the learner counts as missing; a Redis outage leaves it pending for another server.
"""

from __future__ import annotations

import asyncio
import time

import redis

from rollout_server.engines.base import SamplingSpec
from rollout_server.rewards import RewardError, ScoreItem
from rollout_server.state import ServerState
from rollout_server.validation import BadRequest, check_length, encode
from tether.logs import get_logger

log = get_logger(__name__)

VERSION_WAIT_S = 30.0
"""Longest wait for the weights an evaluation prompt asks for before generating with what is loaded."""


class Evaluator:
    def __init__(self, state: ServerState, reward) -> None:  # reward: the worker's scorer, shared
        assert state.sink is not None
        self.state, self.sink, self.reward = state, state.sink, reward
        self.done = 0

    async def step(self) -> bool:
        """Do one waiting evaluation prompt, if any; whether there was one."""
        try:
            items = await self.sink.read_val_prompts(count=1)
        except redis.RedisError as e:
            log.warning("val_read_failed", error=str(e))
            return False
        for item in items:
            try:
                try:
                    result = await self._run(item)
                except redis.RedisError:
                    raise
                except Exception as err:  # the engine failed this prompt: report it (counted missing)...
                    if self.state.draining:  # ...unless this server is going away: another one redoes it
                        log.info("val_left_for_another_server", entry_id=item.entry_id, error=repr(err))
                        continue
                    log.error("val_failed", entry_id=item.entry_id, error=repr(err))
                    result = self._result(item, error=f"generation failed: {err!r}"[:500])
                await self.sink.finish_val(item, result)
                self.done += 1
                self.state.metrics.groups.labels("validation").inc()
            except redis.RedisError as e:  # left pending: reclaimed after claim_idle_ms
                log.warning("val_failed_redis", entry_id=item.entry_id, error=str(e))
        return bool(items)

    def _result(self, item, *, error: str = ""):
        from buffer.evaluation import ValResult

        return ValResult(round=item.round, index=int(item.prompt.dataset_index), version=item.version,
                         server_id=self.state.server_id, error=error)  # fmt: skip

    async def _run(self, item):
        e, rc = self.state.engine, self.state.cfg.rollout
        result = self._result(item)
        deadline = time.monotonic() + VERSION_WAIT_S
        while e.policy_version < item.version and time.monotonic() < deadline and not self.state.draining:
            await asyncio.sleep(0.05)
        try:
            ids = list(item.prompt.token_ids) or encode(e.tokenizer, item.prompt.text)
            check_length(ids, rc, max_model_len=e.max_model_len)
        except BadRequest as err:
            result.error = f"bad prompt: {err}"
            return result
        spec = SamplingSpec(n=item.n, temperature=item.temperature, max_tokens=item.max_tokens, stop=tuple(rc.stop))
        samples = await e.generate(ids, spec, request_id=f"val-{item.entry_id}-{time.monotonic_ns()}")
        scored = [
            ScoreItem(
                item.prompt.text, x.text, ids, x.token_ids, item.prompt.reward_context, f"val-{item.entry_id}-{i}"
            )
            for i, x in enumerate(samples)
        ]
        try:
            scores = await self.reward.score(scored)
        except RewardError as err:
            result.error = f"reward failed: {err}"
            return result
        result.rewards = [float(r) for r, _ in scores]
        result.versions = [min(x.versions) if x.versions else e.policy_version for x in samples]
        result.tokens = sum(len(x.token_ids) for x in samples)
        return result
