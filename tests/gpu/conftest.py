"""The GPU suite: collected everywhere, skipped with a reason where it cannot run.

Every test here is marked ``gpu`` (one CUDA device) or ``gpu2`` (two: NCCL between ranks, which cannot
share one GPU). Without CUDA they are skipped with the reason, so ``pytest -m gpu --collect-only`` lists
the suite on any machine and ``make test-gpu`` on a GPU machine runs it (and fails if nothing ran: see
``tests/gpu/verdict.py``). Each test compares against a reference — the CPU path, the fp32 path, the
plain kernel — never just "it ran".

``TETHER_GPU_SUITE_ON_CPU=1`` runs the one-GPU tests on the CPU instead (``tests.gpu.helpers.DEVICE``): no
evidence about CUDA, but it keeps the suite's own code from rotting between the rare GPU runs (CI does it).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.gpu.helpers import ON_CPU


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available() or ON_CPU
    count = torch.cuda.device_count()
    for item in items:
        if item.get_closest_marker("gpu2") and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA devices for NCCL between ranks; {count} visible"))
        elif item.get_closest_marker("gpu") and not cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def one_rank() -> Iterator[None]:
    """A 1-rank process group with gloo for CPU tensors and NCCL for CUDA ones (FSDP2 on either device)."""
    if dist.is_initialized():
        yield
        return
    backend = "gloo" if ON_CPU or not torch.cuda.is_available() else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
