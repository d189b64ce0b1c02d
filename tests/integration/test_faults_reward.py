"""The reward service down, then back: the configured retries, a counted dead letter, then scoring again.

tests/integration/test_rollout_worker.py covers a *slow* service (deadline exceeded → retried →
dead-lettered). Here nothing listens at the address at first (connection refused: UNAVAILABLE, also
retryable); the group is dead-lettered and counted, its prompt acknowledged, and the prompt worker
keeps going: once a service is listening on that address, the next prompt's group is scored and
written. The dead letter also gives the prompt's admission slot back (``rollout_dead_letter``), so a
learner waiting for data is not starved by groups that will never come.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis

from buffer import PromptQueue, RedisKeys, TrajectoryReader
from tether.config import load_config
from tether.redis_server import free_port
from tether.tasks import demo_rows
from tether.v1 import trajectory_pb2

pytestmark = pytest.mark.slow


def _prompt(i: int) -> trajectory_pb2.Prompt:
    row = list(zip(range(i + 1), demo_rows(seed=2), strict=False))[-1][1]
    return trajectory_pb2.Prompt(prompt_id=f"p{i}", dataset_index=i, text=row["prompt"],
                                 reward_context={"answer": row["answer"]})  # fmt: skip


async def _until(check, what: str, timeout_s: float = 60) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_reward_service_down_then_back(tiny_model_dir: Path, redis_url: str) -> None:
    from rollout_server.engines import build_engine
    from rollout_server.metrics import ServerMetrics
    from rollout_server.sink import BufferSink
    from rollout_server.state import ServerState
    from rollout_server.worker import PromptWorker
    from tether.reward_service import RewardService, start_server

    class Constant(RewardService):
        async def score(self, req):  # type: ignore[no-untyped-def]
            return 0.5

    port = free_port()  # nothing listens here yet
    run_id = f"rdown-{uuid.uuid4().hex[:6]}"
    cfg = load_config(None, [
        "--model.path", str(tiny_model_dir), "--run.run_id", run_id, "--buffer.redis_url", redis_url,
        "--rollout.n", "2", "--rollout.max_tokens", "4", "--rollout.prompt_workers", "1",
        "--rollout.reward_attempts", "2",
        "--rollout.reward", f"{{type: remote, address: '127.0.0.1:{port}', timeout_s: 1, max_retries: 1}}",
    ])  # fmt: skip
    engine = build_engine(cfg)
    await engine.start()
    state = ServerState(cfg, engine, "rollout-rd", ServerMetrics("rollout-rd"), sink=BufferSink(cfg, "rollout-rd"))
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(run_id)
    queue = PromptQueue(client, keys)
    queue.feed(iter([_prompt(0)]), version=0, prompts_per_version=10, max_staleness=0)
    task = asyncio.create_task(PromptWorker(state).run())
    reward_server = None
    try:
        await _until(lambda: client.xlen(keys.dead_letter) == 1, "the dead letter")
        fields = client.xrange(keys.dead_letter)[0][1]
        assert b"reward failed" in fields[b"reason"] and b"UNAVAILABLE" in fields[b"reason"]
        await _until(lambda: client.xpending(keys.prompts, "rollout")["pending"] == 0, "the prompt's ack")
        assert state.metrics.dead_lettered._value.get() == 1
        assert state.metrics.reward_failures._value.get() == 2  # reward_attempts
        assert int(client.hget(keys.counters, "rollout_dead_letter")) == 1  # the admission slot comes back
        assert client.xlen(keys.trajectories) == 0

        # the service comes up on the configured address; the same worker scores the next prompt
        reward_server, _, bound = await start_server(Constant(), port=port, host="127.0.0.1")
        assert bound == port
        # (its channel reconnects within the capped gRPC reconnect backoff: a prompt answered before
        # that is dead-lettered like the first, so keep offering prompts until one is scored)
        for i in range(1, 20):
            queue.feed(iter([_prompt(i)]), version=0, prompts_per_version=100, max_staleness=0)
            await _until(lambda: client.xpending(keys.prompts, "rollout")["pending"] == 0 and not client.xlen(
                keys.prompts), "the prompt to be answered")  # fmt: skip
            if client.xlen(keys.trajectories):
                break
        assert client.xlen(keys.trajectories) == 1
        reader = TrajectoryReader(client, keys, cfg.buffer, consumer="check")
        (got,) = reader.read(1, current_version=0, max_staleness=0, block_ms=1000)
        assert [t.reward for t in got.group.trajectories] == [0.5, 0.5]
        reader.ack([got.entry_id])
        assert int(client.hget(keys.counters, "rollout_dead_letter")) == client.xlen(keys.dead_letter)
        assert not task.done()
    finally:
        state.draining = True
        await asyncio.wait_for(task, 30)
        await engine.shutdown()
        if reward_server is not None:
            await reward_server.stop(None)
        state.sink.close()
        client.close()
