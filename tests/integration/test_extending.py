"""docs/EXTENDING.md's recipes, each done once: a toy engine, a toy policy loss, a toy advantage estimator.

The engine is one class implementing :class:`rollout_server.engines.Engine` (only ``stream`` does real
work); a real prompt worker drives it and its samples land in a real Redis buffer with their log-probs and
per-token versions. The loss and the estimator are one function each in their registry; a real trainer
step (tiny model, one gloo rank) must call them: the loss doubled gives exactly doubled gradients, and an
estimator that returns zero advantages gives zero policy gradients.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import torch
import torch.distributed as dist
from torch.testing import assert_close

from buffer import PromptQueue, TrajectoryReader
from rollout_server.engines import Chunk, Engine, SamplingSpec
from tether.config import TetherConfig, load_config
from tether.redis_server import free_port
from tether.v1 import trajectory_pb2


class CountingEngine(Engine):
    """Answers every sample with the tokens 10, 11, ... (``max_tokens`` of them), log-prob -0.5 each."""

    name = "counting"
    max_model_len = 4096

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self._paused = False

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        for index in range(spec.n):
            tokens = list(range(10, 10 + spec.max_tokens))
            yield Chunk(index, tokens, [-0.5] * len(tokens), [self.policy_version] * len(tokens), finish_reason=2)

    async def abort(self, request_id: str) -> None:
        pass

    async def pause(self, inflight="keep") -> None:  # type: ignore[no-untyped-def]
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused


async def test_a_new_engine_is_one_class(tiny_model_dir: Path, redis_url: str, redis_client: redis.Redis) -> None:
    from transformers import AutoTokenizer

    from rollout_server.metrics import ServerMetrics
    from rollout_server.sink import BufferSink
    from rollout_server.state import ServerState
    from rollout_server.worker import PromptWorker

    cfg = load_config(
        None,
        ["--model.path", str(tiny_model_dir), "--run.run_id", f"ext-{uuid.uuid4().hex[:6]}",
         "--buffer.redis_url", redis_url, "--rollout.n", "3", "--rollout.max_tokens", "5",
         "--rollout.reward", "{type: exact_match}"],
    )  # fmt: skip
    engine = CountingEngine(AutoTokenizer.from_pretrained(tiny_model_dir))
    engine.policy_version = 7
    state = ServerState(cfg, engine, "rollout-toy", ServerMetrics("rollout-toy"), sink=BufferSink(cfg, "toy"))
    keys = state.sink.keys
    prompt = trajectory_pb2.Prompt(prompt_id="p0", text="count:", reward_context={"answer": "x"})
    PromptQueue(redis_client, keys).feed(iter([prompt]), version=7, prompts_per_version=1, max_staleness=0)
    task = asyncio.create_task(PromptWorker(state).run())
    reader = TrajectoryReader(redis_client, keys, cfg.buffer, consumer="learner-0")
    try:
        got = []
        for _ in range(100):
            got = await asyncio.to_thread(reader.read, 1, current_version=7, max_staleness=0, block_ms=200)
            if got or task.done():
                break
        if task.done():
            task.result()
    finally:
        state.draining = True
        await asyncio.wait_for(task, 30)
        state.sink.close()
    (buffered,) = got
    trajectories = buffered.group.trajectories
    assert len(trajectories) == 3
    for t in trajectories:
        assert t.completion_token_ids.tolist() == [10, 11, 12, 13, 14]
        assert t.behavior_logprobs.tolist() == pytest.approx([-0.5] * 5)
        assert t.policy_versions.tolist() == [7] * 5


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _first_grads(model_dir: Path, **algorithm: object) -> dict[str, torch.Tensor]:
    """The first update's gradients of a fresh trainer on fixed synthetic groups (no clipping in reach)."""
    from learner.parallelize import load_model
    from learner.synthetic import make_groups
    from learner.trainer import Trainer

    cfg = TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 24},
            "learner": {"train_batch_size": 4, "lr": 1e-2, "lr_warmup_steps": 0, "grad_clip": 1e9,
                        "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},
            "algorithm": {"max_staleness": 1},
        }
    )  # fmt: skip
    # The registries are open; the config's names are a closed list (a typo fails at load): a new entry
    # also adds its name there (docs/EXTENDING.md), which this test stands in for.
    cfg.algorithm = cfg.algorithm.model_copy(update=algorithm)
    torch.manual_seed(0)
    model = load_model(cfg, torch.device("cpu"))
    trainer = Trainer(cfg, model, device=torch.device("cpu"), ref_model=None)
    grads: dict[str, torch.Tensor] = {}

    def keep(*_) -> None:  # type: ignore[no-untyped-def]
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(keep)
    trainer.train_step(make_groups(4, 4, vocab=256, seed=0), version=1)
    return grads


def test_a_new_policy_loss_is_one_function(one_rank, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import losses

    calls = []

    def doubled(**kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        loss, metrics = losses.policy_loss(**kw)
        return 2 * loss, metrics

    monkeypatch.setitem(losses.POLICY_LOSSES, "doubled", doubled)
    base = _first_grads(tiny_model_dir)
    toy = _first_grads(tiny_model_dir, loss_mode="doubled")
    assert calls and base.keys() == toy.keys()
    for name in base:
        assert_close(toy[name], 2 * base[name], rtol=1e-4, atol=1e-7)


def test_a_new_estimator_is_one_function(one_rank, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import advantages

    def nothing(batch, cfg):  # type: ignore[no-untyped-def]
        zeros = torch.zeros_like(batch.token_rewards)
        return zeros, zeros

    monkeypatch.setitem(advantages.ESTIMATORS, "nothing", advantages.Estimator(nothing, needs_critic=False))
    base = _first_grads(tiny_model_dir)
    toy = _first_grads(tiny_model_dir, adv_estimator="nothing", entropy_coeff=0.0)
    assert any(g.abs().max() > 0 for g in base.values())  # the real estimator moves the weights
    assert all(g.abs().max() == 0 for g in toy.values())  # zero advantages, no entropy/KL term: no gradient
