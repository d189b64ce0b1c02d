"""Shared pieces of the GPU suite: a config for the tiny model, seeded samples, and packed micro-batches."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from learner.packing import MicroBatch, Sample, make_micro_batch
from tether.config import TetherConfig

ON_CPU = os.environ.get("TETHER_GPU_SUITE_ON_CPU") == "1" and not torch.cuda.is_available()
"""Dry run of the one-GPU tests on the CPU (see ``tests/gpu/conftest.py``)."""
DEVICE = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)


def config(model_dir: Path, **learner: object) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "model": {"path": str(model_dir), "attn_implementation": learner.pop("attn", "sdpa")},
            "rollout": {"max_tokens": 32},
            "learner": {
                "train_batch_size": 4,
                "lr": 1e-3,
                "lr_warmup_steps": 0,
                "max_token_len_per_gpu": 512,
                "device": "cuda",
                **learner,
            },
        }
    )


def samples(n: int = 6, *, vocab: int = 256, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c = int(rng.integers(4, 12)), int(rng.integers(8, 40))
        out.append(
            Sample(
                input_ids=rng.integers(0, vocab, p + c).astype(np.int64),
                prompt_len=p,
                behavior_logprobs=-rng.random(c).astype(np.float32),
                loss_mask=np.ones(c, dtype=np.float32),
                advantage=float(rng.standard_normal()),
                group=i // 2,
            )
        )
    return out


def packed(s: list[Sample]) -> MicroBatch:
    return make_micro_batch(s, list(range(len(s))), packed=True)


def flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, gathered and flattened in float32 on the CPU (DTensor shards included)."""
    from torch.distributed.tensor import DTensor

    parts = []
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        parts.append(full.detach().float().cpu().reshape(-1))
    return torch.cat(parts)
