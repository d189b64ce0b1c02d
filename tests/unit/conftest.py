"""Fixtures the learner's unit tests share: one gloo rank and the demo-sized tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tether.redis_server import free_port


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    if dist.is_initialized():  # a group another test left up serves as well
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.commands.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, heads=2, seed=0)
