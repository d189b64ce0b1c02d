"""The demo learner's rank in one process, for the benchmarks that time its step: the demo model (64 wide ×
2 layers), a one-rank gloo group, the trainer on fixed synthetic groups, and a sender to one bare receiver
process (``tests.weight_receiver``) by filesystem snapshots."""

from __future__ import annotations

from pathlib import Path


class DemoRank:
    """``shard``: as :func:`learner.parallelize.parallelize` takes it (None: FSDP2 only where it does something)."""

    def __init__(self, workdir: Path, *, shard: bool | None = None) -> None:
        import os

        import torch
        import torch.distributed as dist
        import yaml

        from learner.parallelize import load_model, parallelize
        from learner.synthetic import make_groups
        from learner.trainer import Trainer
        from tests.weight_receiver import ReceiverProcess
        from tether.commands.tiny_model import make_tiny_model
        from tether.config.loader import load_config
        from tether.redis_server import free_port
        from weight_sync.sender import WeightSender

        model_dir = make_tiny_model(workdir / "model", hidden=64, layers=2, heads=2, seed=0)
        config = workdir / "config.yaml"
        config.write_text(yaml.safe_dump({
            "run": {"run_id": "bench", "output_dir": str(workdir / "runs")},
            "model": {"path": str(model_dir)},
            "rollout": {"max_tokens": 8, "n": 8},
            "learner": {"train_batch_size": 8, "lr": 3e-3, "total_steps": 10**6, "device": "cpu"},
            "algorithm": {"max_staleness": 1, "loss_agg_mode": "token-mean"},
            "weight_sync": {"transport": {"type": "filesystem"}},
        }))  # fmt: skip
        cfg = load_config(config)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        self.model = parallelize(load_model(cfg, device), cfg, device, shard=shard)
        self.trainer = Trainer(cfg, self.model, device=device, ref_model=None)
        self.receiver = ReceiverProcess(config=config, model=model_dir, workdir=workdir)
        self.sender = WeightSender(cfg, model=self.model, servers=[self.receiver.address])
        self.groups = make_groups(8, 8, vocab=self.model.config.vocab_size, seed=0, completion_len=(8, 8))
        self.version = 0

    def close(self) -> None:
        import torch.distributed as dist

        self.sender.close()
        self.receiver.stop()
        dist.destroy_process_group()
