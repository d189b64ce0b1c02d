"""What reaches the learner, and what is counted instead (real Redis, real engine, real reward service).

Aborted samples (partial tokens) are neither scored nor trained and are counted; episode groups that
never fill are counted in the buffer stats; stale drops of episode groups free no admission slot (only
prompt-born groups were admitted); episodes refuse truncated sampling and record their temperature.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis

from buffer import PromptQueue, RedisKeys, TrajectoryReader, TrajectoryWriter, buffer_stats
from learner.batch import build_samples
from tests.unit.test_buffer_codec import make_group
from tether.config import load_config
from tether.config.buffer import BufferConfig
from tether.trajectory import PROMPT_GROUP_PREFIX, TEMPERATURE_KEY
from tether.v1 import rollout_pb2, trajectory_pb2

pytestmark = pytest.mark.slow


def test_stale_episode_groups_free_no_admission_slot(redis_client: redis.Redis) -> None:
    keys = RedisKeys(f"ad-{uuid.uuid4().hex[:6]}")
    cfg = BufferConfig(claim_idle_ms=200, put_timeout_s=0.3)
    q = PromptQueue(redis_client, keys)
    source = iter([trajectory_pb2.Prompt(prompt_id=str(i), dataset_index=i, text="q") for i in range(100)])
    assert q.feed(source, version=0, prompts_per_version=4, max_staleness=1) == 8  # (1 + 0 + 1)·4
    writer = TrajectoryWriter(redis_client, keys, cfg)
    prompt_born, env_born = make_group(seed=0, version=1), make_group(seed=1, version=1)
    prompt_born.group_id, env_born.group_id = f"{PROMPT_GROUP_PREFIX}1-0", "episode-abc"
    for t in prompt_born.trajectories + env_born.trajectories:
        t.group_id = ""
    writer.put(prompt_born)
    writer.put(env_born)
    reader = TrajectoryReader(redis_client, keys, cfg)
    assert reader.read(2, current_version=9, max_staleness=1, block_ms=300) == []  # both stale
    raw = redis_client.hmget(keys.counters, "dropped_stale", "dropped_stale_env")
    assert [int(v) for v in raw] == [1, 1]
    s = buffer_stats(redis_client, keys)
    assert (s["buffer/dropped_stale"], s["buffer/dropped_stale_env"]) == (2, 1)
    assert s["buffer/produced"] == s["buffer/acknowledged"] + s["buffer/dropped_stale"] + s["buffer/depth"]
    # Only the prompt-born drop gives its slot back: one more prompt, not two.
    assert q.feed(source, version=0, prompts_per_version=4, max_staleness=1) == 1


@pytest.fixture
async def state(tiny_model_dir: Path, redis_url: str):
    """A rollout server's state in-process: transformers engine, Redis sink, metrics."""
    from rollout_server.engines import build_engine
    from rollout_server.metrics import ServerMetrics
    from rollout_server.sink import BufferSink
    from rollout_server.state import ServerState

    async def make(*args: str):
        cfg = load_config(
            None,
            ["--model.path", str(tiny_model_dir), "--run.run_id", f"dp-{uuid.uuid4().hex[:6]}",
             "--buffer.redis_url", redis_url, *args],
        )  # fmt: skip
        engine = build_engine(cfg)
        await engine.start()
        made.append(ServerState(cfg, engine, "rollout-dp", ServerMetrics("rollout-dp"), sink=BufferSink(cfg, "dp")))
        return made[-1]

    made: list = []
    yield make
    for s in made:
        await s.engine.shutdown()
        s.sink.close()


async def test_aborted_samples_are_not_scored_trained_or_uncounted(state, redis_client: redis.Redis) -> None:
    from rollout_server.worker import PromptWorker
    from tether.reward_service import RewardService, start_server

    scored: list[str] = []

    class Everything(RewardService):
        def score(self, req):
            scored.append(req.trajectory_id)
            return 1.0

    reward_server, _, reward_port = await start_server(Everything(), port=0, host="127.0.0.1")
    s = await state(
        "--rollout.n", "4", "--rollout.max_tokens", "256", "--rollout.prompt_workers", "1",
        "--rollout.reward", f"{{type: remote, address: '127.0.0.1:{reward_port}'}}",
    )  # fmt: skip
    keys = s.sink.keys
    PromptQueue(redis_client, keys).feed(
        iter([trajectory_pb2.Prompt(prompt_id="p0", text="count:")]), version=0, prompts_per_version=4, max_staleness=0
    )
    loop, steps, step_sync = asyncio.get_running_loop(), asyncio.Event(), s.engine._step_sync
    emitted: list[int] = []

    def counting_step(state, params, **kw):  # the real step (engine thread); counts the steps of all 4 rows
        out = step_sync(state, params, **kw)
        if state["ids"].shape[0] == 4:  # all four samples in the batch (they may join it one by one)
            emitted.append(1)
        if len(emitted) == 4:  # the 4th step's forward is done, so the first 3 steps' tokens are recorded
            loop.call_soon_threadsafe(steps.set)
        return out

    s.engine._step_sync = counting_step
    task = asyncio.create_task(PromptWorker(s).run())
    try:
        await asyncio.wait_for(steps.wait(), 120)  # at least three tokens per sample are out
        for rid in list(s.engine._requests):
            await s.engine.abort(rid)  # what a failed batch or a cancelled request ends in
        reader = TrajectoryReader(redis_client, keys, s.cfg.buffer, consumer="learner-0")
        got = []
        for _ in range(200):
            # off the event loop: the worker runs on it
            got = await asyncio.to_thread(reader.read, 1, current_version=0, max_staleness=0, block_ms=300)
            if got or task.done():
                break
        if task.done():
            task.result()
        (buffered,) = got
    finally:
        s.draining = True
        await asyncio.wait_for(task, 30)
        await reward_server.stop(None)
    trajectories = buffered.group.trajectories
    aborted = [t for t in trajectories if t.finish_reason == trajectory_pb2.FINISH_REASON_ABORTED]
    assert aborted, "no sample was cut off; the test did not exercise the path"
    assert all(t.num_completion_tokens >= 3 for t in aborted)  # partial tokens, not empty samples
    finished = [t for t in trajectories if t.finish_reason != trajectory_pb2.FINISH_REASON_ABORTED]
    assert sorted(scored) == sorted(t.id for t in finished)
    assert all(t.reward == 0.0 for t in aborted) and all(t.reward == 1.0 for t in finished)
    assert s.metrics.aborted_samples._value.get() == len(aborted)
    samples, skipped = build_samples([buffered.group], current_version=0)
    assert skipped["aborted"] == len(aborted) and len(samples) == len(trajectories) - len(aborted) - skipped.get(
        "empty_completion", 0
    )


async def test_unfilled_episode_groups_are_counted(state, redis_client: redis.Redis) -> None:
    from rollout_server.episodes import EpisodeStore

    s = await state("--rollout.max_tokens", "4", "--rollout.episode_idle_timeout_s", "1.0")
    store = EpisodeStore(s)
    sweeper = asyncio.create_task(store.sweep_forever())
    try:
        ep = await store.open(rollout_pb2.OpenEpisodeRequest(text="hi", group_id="pair", group_size=2))
        await store.step(rollout_pb2.StepRequest(episode_id=ep.episode_id))
        out = await store.close(rollout_pb2.CloseEpisodeRequest(episode_id=ep.episode_id, reward=1.0))
        assert not out.group_written  # its partner never comes
        for _ in range(200):  # dropped after twice the idle timeout
            if buffer_stats(redis_client, s.sink.keys)["buffer/episode_groups_incomplete"]:
                break
            await asyncio.sleep(0.05)
        assert buffer_stats(redis_client, s.sink.keys)["buffer/episode_groups_incomplete"] == 1
    finally:
        sweeper.cancel()


async def test_episodes_refuse_truncated_sampling_and_record_their_temperature(
    state, redis_client: redis.Redis
) -> None:
    from rollout_server.episodes import EpisodeStore
    from rollout_server.validation import BadRequest

    s = await state("--rollout.max_tokens", "4")
    store = EpisodeStore(s)
    for sampling, key in ((rollout_pb2.SamplingParams(top_p=0.9), "sampling.top_p"),
                          (rollout_pb2.SamplingParams(top_k=5), "sampling.top_k")):  # fmt: skip
        with pytest.raises(BadRequest, match=rf"^{key}: episodes are trained on"):
            await store.open(rollout_pb2.OpenEpisodeRequest(text="hi", sampling=sampling))
    with pytest.raises(BadRequest, match=r"^group_id: the prefix 'prompt-' is reserved"):
        await store.open(rollout_pb2.OpenEpisodeRequest(text="hi", group_id="prompt-1-0"))
    ep = await store.open(
        rollout_pb2.OpenEpisodeRequest(text="hi", sampling=rollout_pb2.SamplingParams(temperature=0.7))
    )
    await store.step(rollout_pb2.StepRequest(episode_id=ep.episode_id))
    await store.close(rollout_pb2.CloseEpisodeRequest(episode_id=ep.episode_id, reward=1.0))
    (got,) = TrajectoryReader(redis_client, s.sink.keys, s.cfg.buffer).read(1, current_version=0, max_staleness=0)
    (t,) = got.group.trajectories
    assert float(t.metadata[TEMPERATURE_KEY]) == pytest.approx(0.7) and t.logprob_source == "processed"
    (sample,), _ = build_samples([got.group], current_version=0)
    assert sample.temperature == pytest.approx(0.7)
