"""Ulysses sequence parallelism on real gloo ranks: SP = 2 trains exactly like SP = 1.

Two spawned processes run the same steps twice — once as two data-parallel ranks (SP = 1), once as one
SP group of two ranks (SP = 2, each rank holding half of every packed row) — and compare the losses,
the gradients of every update (gathered before the optimizer step) and the weights after it. The KL
reference and the separate proximal pass run through the sequence-parallel forward as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from tests.helpers import leave_group
from tether.redis_server import free_port

pytestmark = pytest.mark.slow

LEARNER = {
    "train_batch_size": 4,
    "ppo_mini_batch_size": 2,
    "lr": 1e-3,
    "total_steps": 10,
    "max_token_len_per_gpu": 40,
    "log_prob_max_token_len_per_gpu": 80,
}


def _run(model_dir: str, sp: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tether.config import TetherConfig

    cfg = TetherConfig.model_validate(
        {
            "model": {"path": model_dir},
            "rollout": {"max_tokens": 32},
            # SP > 1 copies the prompt per sample; SP 1 does the same here, so both run one layout
            "learner": {**LEARNER, "ulysses_sequence_parallel_size": sp, "share_prompts": False},
            "algorithm": {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1},
        }
    )
    dev = torch.device("cpu")
    torch.manual_seed(0)
    model = parallelize(load_model(cfg, dev), cfg, dev)
    ref = parallelize(load_model(cfg, dev), cfg, dev, trainable=False)
    trainer = Trainer(cfg, model, device=dev, ref_model=ref)
    trainer.reuse_update_forward = False  # the forward-only proximal pass runs too
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(*_) -> None:  # collective: every rank runs it before every optimizer step
        n = len(grads) // sum(1 for _ in model.parameters())
        for name, p in model.named_parameters():
            grads[f"{n}/{name}"] = p.grad.full_tensor().clone()

    trainer.optimizer.register_step_pre_hook(keep_grads)
    rows = [trainer.train_step(make_groups(4, 4, vocab=256, seed=s, completion_len=(4, 40)), version=0) for s in (0, 1)]
    for name, p in model.named_parameters():
        grads[f"final/{name}"] = p.full_tensor().detach().clone()
    return rows, grads


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for sp in (1, 2):
        rows, tensors = _run(model_dir, sp)
        if rank == 0:
            Path(out, f"sp{sp}.json").write_text(json.dumps(rows))
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out, f"sp{sp}.st")))
    leave_group()


def test_sp2_gives_the_losses_and_gradients_of_sp1(tiny_model_dir: Path, tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2)
    rows = {sp: json.loads((tmp_path / f"sp{sp}.json").read_text()) for sp in (1, 2)}
    tensors = {sp: load_file(str(tmp_path / f"sp{sp}.st")) for sp in (1, 2)}
    for a, b in zip(rows[1], rows[2], strict=True):
        for key in ("loss/total", "loss/pg", "loss/kl", "loss/entropy", "actor/clipfrac", "actor/grad_norm"):
            assert_close(b[key], a[key], atol=1e-5, rtol=1e-4, msg=key)
    assert set(tensors[1]) == set(tensors[2])
    assert sum(k.startswith("3/") for k in tensors[1]) > 0  # two steps of two updates each were captured
    for name, ref in tensors[1].items():
        assert ref.abs().sum() > 0, name
        assert_close(tensors[2][name], ref, atol=1e-5, rtol=1e-4, msg=name)
