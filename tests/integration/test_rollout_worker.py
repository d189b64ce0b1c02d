"""The prompt worker end to end (server process, real Redis), graceful drain, and reward failures.

The drain test runs last in the module because it stops the module's server.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from buffer import PromptQueue, RedisKeys, ServerRegistry, TrajectoryReader
from rollout_server.launch import ServerProcess, spawn_server
from tether.client import RolloutClient
from tether.config import load_config
from tether.redis_server import free_port
from tether.tasks import demo_rows
from tether.v1 import trajectory_pb2

pytestmark = pytest.mark.slow
G = 4


@pytest.fixture(scope="module")
def run_id() -> str:
    return f"rw-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, redis_server: str, run_id: str, tmp_path_factory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("worker")
    proc = spawn_server(
        [
            "--model.path",
            str(tiny_model_dir),
            "--run.run_id",
            run_id,
            "--run.output_dir",
            str(tmp / "runs"),
            "--buffer.redis_url",
            redis_server,
            "--rollout.server_id",
            "rollout-test",
            "--rollout.prompt_workers",
            "2",
            "--rollout.n",
            str(G),
            "--rollout.max_tokens",
            "128",
            "--rollout.heartbeat_s",
            "0.5",
            "--rollout.drain_timeout_s",
            "30",
        ],
        port=free_port(),
        log_path=tmp / "server.log",
    )
    yield proc
    proc.terminate()


def _prompts(n: int):
    for i, row in zip(range(n), demo_rows(seed=1), strict=False):
        yield trajectory_pb2.Prompt(
            prompt_id=f"p{i}", dataset_index=i, text=row["prompt"], reward_context={"answer": row["answer"]}
        )


def test_prompt_worker_turns_n_prompts_into_n_groups(server: ServerProcess, redis_server: str, run_id: str) -> None:
    # The session's Redis, not the ``redis_url`` fixture: that one flushes the database when the test starts,
    # after the module's server registered, and on a fast machine the groups were done before its next
    # heartbeat put the entry back (the run id is this module's own, so nothing else shares these keys).
    client = redis.Redis.from_url(redis_server)
    keys = RedisKeys(run_id)
    n = 5
    assert PromptQueue(client, keys).feed(_prompts(n), version=0, prompts_per_version=100, max_staleness=0) == n
    reader = TrajectoryReader(client, keys, load_config(None, []).buffer, consumer="learner-0")
    groups, deadline = [], time.monotonic() + 120
    while len(groups) < n and time.monotonic() < deadline:
        groups += reader.read(n - len(groups), current_version=0, max_staleness=10, block_ms=500)
    assert len(groups) == n, server.log_tail()
    assert len({b.group.group_id for b in groups}) == n
    assert {b.group.prompt_id for b in groups} == {f"p{i}" for i in range(n)}
    for b in groups:
        assert len(b.group.trajectories) == G
        for t in b.group.trajectories:
            assert 0 < t.num_completion_tokens <= 128
            assert t.loss_mask.tolist() == [1] * t.num_completion_tokens
            assert set(t.policy_versions.tolist()) == {0} and 0.0 <= t.reward <= 1.0
            assert t.server_id == "rollout-test"
    live = ServerRegistry(client, keys).live()
    assert [s.server_id for s in live] == ["rollout-test"] and live[0].address == server.address
    client.close()


def test_a_prompts_max_tokens_caps_its_completions_and_one_above_the_limit_is_dead_lettered(
    server: ServerProcess, redis_server: str, run_id: str
) -> None:
    client = redis.Redis.from_url(redis_server)
    keys = RedisKeys(run_id)
    capped = [trajectory_pb2.Prompt(prompt_id=f"cap{i}", text="digits:", max_tokens=3) for i in range(2)]
    over = trajectory_pb2.Prompt(prompt_id="over", text="digits:", max_tokens=129)  # the server allows 128
    assert PromptQueue(client, keys).feed(iter([*capped, over]), version=0, prompts_per_version=100, max_staleness=9)
    reader = TrajectoryReader(client, keys, load_config(None, []).buffer, consumer="learner-0")
    groups, deadline = [], time.monotonic() + 120
    while len(groups) < 2 and time.monotonic() < deadline:
        groups += reader.read(2 - len(groups), current_version=0, max_staleness=10, block_ms=500)
    assert sorted(b.group.prompt_id for b in groups) == ["cap0", "cap1"], server.log_tail()
    assert all(0 < t.num_completion_tokens <= 3 for b in groups for t in b.group.trajectories)
    reader.ack([b.entry_id for b in groups])
    while time.monotonic() < deadline and not client.xlen(keys.dead_letter):
        time.sleep(0.2)
    reasons = [f[b"reason"].decode() for _, f in client.xrange(keys.dead_letter)]
    assert any("max_tokens 129 is outside 0..128" in r for r in reasons), reasons
    client.close()


def test_sigterm_drains_in_flight_work_and_exits_zero(server: ServerProcess, redis_server: str, run_id: str) -> None:
    result: dict[str, object] = {}

    def long_stream() -> None:
        with RolloutClient(server.address, timeout_s=120) as c:
            chunks = list(c.generate_stream(text="go", n=1, max_tokens=128, temperature=0.0))
            result["tokens"] = sum(len(ch.token_ids) for ch in chunks)
            result["finish"] = chunks[-1].finish_reason

    thread = threading.Thread(target=long_stream)
    thread.start()
    time.sleep(0.3)
    assert server.terminate(timeout_s=60) == 0
    thread.join(timeout=10)
    assert result.get("finish") in (trajectory_pb2.FINISH_REASON_STOP, trajectory_pb2.FINISH_REASON_LENGTH), result
    client = redis.Redis.from_url(redis_server)
    assert ServerRegistry(client, RedisKeys(run_id)).live() == []  # deregistered on the way out
    client.close()
    assert "rollout_server_stopped" in server.log_tail(60)


async def test_failing_reward_service_dead_letters_the_group(tiny_model_dir: Path, redis_url: str) -> None:
    """A reward service that times out: the group is retried, then dead-lettered; the prompt is acked."""
    from rollout_server.engines import build_engine
    from rollout_server.metrics import ServerMetrics
    from rollout_server.sink import BufferSink
    from rollout_server.state import ServerState
    from rollout_server.worker import PromptWorker
    from tether.reward_service import RewardService, start_server

    class Slow(RewardService):
        async def score(self, req):
            await asyncio.sleep(5)
            return 1.0

    reward_server, _, reward_port = await start_server(Slow(), port=0, host="127.0.0.1")
    run_id = f"rd-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        [
            "--model.path",
            str(tiny_model_dir),
            "--run.run_id",
            run_id,
            "--buffer.redis_url",
            redis_url,
            "--rollout.n",
            "2",
            "--rollout.max_tokens",
            "4",
            "--rollout.prompt_workers",
            "1",
            "--rollout.reward_attempts",
            "2",
            "--rollout.reward",
            f"{{type: remote, address: '127.0.0.1:{reward_port}', timeout_s: 0.2, max_retries: 1}}",
        ],
    )
    engine = build_engine(cfg)
    await engine.start()
    state = ServerState(cfg, engine, "rollout-dl", ServerMetrics("rollout-dl"), sink=BufferSink(cfg, "rollout-dl"))
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(run_id)
    PromptQueue(client, keys).feed(_prompts(1), version=0, prompts_per_version=10, max_staleness=0)
    task = asyncio.create_task(PromptWorker(state).run())
    try:
        for _ in range(200):
            if client.xlen(keys.dead_letter):
                break
            await asyncio.sleep(0.05)
        entries = client.xrange(keys.dead_letter)
        assert len(entries) == 1
        fields = entries[0][1]
        assert fields[b"source"] == b"rollout:rollout-dl" and b"DEADLINE_EXCEEDED" in fields[b"reason"]
        for _ in range(40):  # the prompt is acknowledged, not left to be redelivered forever
            if client.xpending(keys.prompts, "rollout")["pending"] == 0:
                break
            await asyncio.sleep(0.05)
        assert client.xpending(keys.prompts, "rollout")["pending"] == 0
        assert state.metrics.dead_lettered._value.get() == 1
        assert state.metrics.reward_failures._value.get() == 2
        assert not task.done()  # the worker is still serving
    finally:
        state.draining = True
        await asyncio.wait_for(task, 10)
        await engine.shutdown()
        await reward_server.stop(None)
        state.sink.close()
        client.close()
