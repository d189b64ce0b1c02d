"""PPO with a critic (``adv_estimator: gae``) through the real trainer and the real ``tether up``.

- Resume is exact: a checkpoint taken after step 1 and loaded into fresh models reproduces step 2's
  actor and critic losses bit for bit; loading it without the critic does not (the critic's state is
  what the checkpoint must carry).
- Two gloo ranks give one rank's actor and critic metrics (each rank scores its share of the values).
- During the critic's warm-up the actor's weights do not move while the critic's do.
- A short ``tether up`` of the demo task with GAE: the critic's value loss falls, and its metrics (an
  explained variance among them) reach ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from learner.checkpoint import TrainState, load_checkpoint, save_checkpoint
from learner.critic import build_critic
from learner.parallelize import load_model, parallelize
from learner.synthetic import make_groups
from learner.trainer import Trainer
from tests.helpers import leave_group
from tests.integration.test_up import REPO, write_config
from tether.config import TetherConfig
from tether.metrics import read_metrics
from tether.redis_server import free_port

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
CRITIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var")


@pytest.fixture(scope="module", autouse=True)
def gloo():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cfg(model_dir: Path, **critic: object) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 16},
            "learner": {"train_batch_size": 4, "ppo_mini_batch_size": 2, "lr": 1e-3, "max_token_len_per_gpu": 96},
            "algorithm": {"adv_estimator": "gae", "gamma": 0.99, "lam": 0.95},
            "critic": {"optim": {"lr": 1e-3}, "ppo_max_token_len_per_gpu": 64, **critic},
        }
    )


def _trainer(cfg: TetherConfig, seed: int) -> Trainer:
    torch.manual_seed(seed)  # a different seed: fresh models that differ from the checkpointed ones
    model = parallelize(load_model(cfg, CPU), cfg, CPU)
    return Trainer(cfg, model, device=CPU, ref_model=None, critic=build_critic(cfg, CPU))


def _groups(seed: int):
    return make_groups(4, 4, vocab=256, seed=seed, prompt_len=(3, 6), completion_len=(3, 10))


def test_resume_reproduces_the_next_steps_losses_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny_model_dir)
    first = _trainer(cfg, seed=0)
    first.train_step(_groups(1), version=0, step=0)
    save_checkpoint(tmp_path, model=first.model, optimizer=first.optimizer, scheduler=first.scheduler,
                    state=TrainState(step=1), critic=first.critic)  # fmt: skip
    want = first.train_step(_groups(2), version=0, step=1)
    assert set(CRITIC_KEYS) <= set(want) and want["critic/vf_loss"] > 0

    resumed = _trainer(cfg, seed=1)
    load_checkpoint(tmp_path / "step_1", model=resumed.model, optimizer=resumed.optimizer,
                    scheduler=resumed.scheduler, critic=resumed.critic)  # fmt: skip
    got = resumed.train_step(_groups(2), version=0, step=1)
    for k in (*CRITIC_KEYS, "loss/pg", "loss/total", "actor/grad_norm", "critic/grad_norm"):
        assert got[k] == want[k], k

    no_critic = _trainer(cfg, seed=1)
    load_checkpoint(tmp_path / "step_1", model=no_critic.model, optimizer=no_critic.optimizer,
                    scheduler=no_critic.scheduler)  # fmt: skip
    other = no_critic.train_step(_groups(2), version=0, step=1)
    assert other["critic/vf_loss"] != want["critic/vf_loss"] and other["loss/pg"] != want["loss/pg"]


def _ranks_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    trainer = _trainer(_cfg(Path(model_dir)), seed=0)
    results = [trainer.train_step(_groups(s), version=0, step=s) for s in range(2)]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    del trainer
    leave_group()


def test_two_ranks_match_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(_cfg(tiny_model_dir), seed=0)  # one rank: this process's group
    one = [trainer.train_step(_groups(s), version=0, step=s) for s in range(2)]
    out = tmp_path / "world2.json"
    mp.spawn(_ranks_worker, args=(2, free_port(), str(tiny_model_dir), str(out)), nprocs=2)
    for a, b in zip(one, json.loads(out.read_text()), strict=True):
        for k in (*CRITIC_KEYS, "critic/grad_norm", "critic/values/mean", "loss/pg", "actor/grad_norm"):
            assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.flatten() for p in full]).detach().clone()


def test_critic_warmup_holds_the_actor_and_trains_the_critic(tiny_model_dir: Path) -> None:
    trainer = _trainer(_cfg(tiny_model_dir, critic_warmup=1), seed=0)
    actor, critic = _flat(trainer.model), _flat(trainer.critic.model)
    out = trainer.train_step(_groups(1), version=0, step=0)
    assert out["actor/warmup"] == 1.0 and "loss/pg" not in out
    assert torch.equal(_flat(trainer.model), actor)
    assert not torch.equal(_flat(trainer.critic.model), critic)
    out = trainer.train_step(_groups(2), version=0, step=1)  # warm-up over: the actor trains
    assert "loss/pg" in out and not torch.equal(_flat(trainer.model), actor)


def test_tether_up_with_gae_trains_its_critic(tmp_path: Path, tiny_model_dir: Path) -> None:
    steps = 12
    path = write_config(tmp_path, tiny_model_dir, run_id="gae", steps=steps)
    cfg = yaml.safe_load(path.read_text())
    cfg["algorithm"].update({"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95})
    cfg["critic"] = {"optim": {"lr": 3e-3}, "ppo_epochs": 2}
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", "tether", "up", "--config", str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    run_dir = tmp_path / "runs" / "gae"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.out")))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(set(CRITIC_KEYS) <= set(r) for r in rows)
    assert all(math.isfinite(r[k]) for r in rows for k in CRITIC_KEYS)
    # The critic learns the returns: its randomly initialised value head starts far off (a value loss of
    # about 0.3 on this task), and a few updates bring it to the returns' scale (about 0.01). Medians of
    # the first 3 and the last 4 steps. The explained variance is logged but not asserted: on 16 samples
    # of a 0/1 reward whose mean is about 0.1 its denominator is near 0, and it moved from -0.41 to -0.40
    # over 12 steps in one CI run (from -0.84 to 0.2 in another).
    loss = [r["critic/vf_loss"] for r in rows]
    early, late = statistics.median(loss[:3]), statistics.median(loss[-4:])
    assert late < early / 3, loss


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_value_loss_aggregates_like_the_actor(tiny_model_dir: Path, mode: str) -> None:
    """verl's ``critic.loss_agg_mode`` follows the actor's ``loss_agg_mode``: with one update over one
    micro-batch the critic's first forward is the values' own, so ``vf_loss`` = 0.5 · agg((V - R)²) — per
    token over all trained tokens, or per sequence first. The critic aggregated token-mean whatever was set."""
    from learner.advantages import assign_advantages
    from learner.batch import build_samples

    cfg = TetherConfig.model_validate(
        {**_cfg(tiny_model_dir).model_dump(), "algorithm": {"adv_estimator": "gae", "loss_agg_mode": mode}}
    )
    critic = build_critic(cfg, CPU)
    samples, _ = build_samples(_groups(3), current_version=0)
    critic.compute_values(samples)
    assign_advantages(samples, cfg.algorithm)
    out = critic.update(samples, [list(range(len(samples)))])
    per_seq = [((s.values - s.returns).astype(float) ** 2, s.loss_mask.astype(float)) for s in samples]
    if mode == "token-mean":
        want = 0.5 * sum((e * m).sum() for e, m in per_seq) / sum(m.sum() for _, m in per_seq)
    else:
        want = 0.5 * statistics.fmean((e * m).sum() / m.sum() for e, m in per_seq)
    assert out["critic/vf_loss"] == pytest.approx(want, rel=1e-5)
