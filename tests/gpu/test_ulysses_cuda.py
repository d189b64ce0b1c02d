"""Ulysses on CUDA: two ranks over NCCL, SP = 2 against SP = 1 in float32, sdpa and flash-attention inside."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.testing import assert_close

from tether.redis_server import free_port

pytestmark = pytest.mark.gpu2


def _worker(rank: int, port: int, model_dir: str, attn: str, out: str) -> None:
    import torch.distributed as dist

    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tests.gpu.helpers import config

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    rows = {}
    for sp in (1, 2):
        dtype = "bfloat16" if attn == "flash_attention_2" else "float32"  # flash-attn has no float32 kernel
        cfg = config(Path(model_dir), attn=attn, ulysses_sequence_parallel_size=sp, param_dtype=dtype,
                     max_token_len_per_gpu=64)  # fmt: skip
        torch.manual_seed(0)
        model = parallelize(load_model(cfg, device), cfg, device)
        trainer = Trainer(cfg, model, device=device, ref_model=None)
        rows[sp] = trainer.train_step(make_groups(4, 4, vocab=256, seed=1, completion_len=(8, 60)), version=0)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_sp2_matches_sp1_on_cuda(tiny_model_dir: Path, tmp_path: Path, attn: str) -> None:
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (pip install -e .[gpu])")
    out = tmp_path / "rows.json"
    mp.spawn(_worker, args=(free_port(), str(tiny_model_dir), attn, str(out)), nprocs=2)
    rows = json.loads(out.read_text())
    tol = {"atol": 1e-4, "rtol": 1e-3} if attn == "sdpa" else {"atol": 2e-2, "rtol": 2e-2}
    for key in ("loss/total", "loss/pg", "actor/grad_norm"):
        assert_close(rows["2"][key], rows["1"][key], **tol, msg=key)
