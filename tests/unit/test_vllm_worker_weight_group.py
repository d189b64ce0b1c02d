"""A vLLM engine of several workers refuses a collective weight transport, clearly and before joining anything.

A weight update plan gives each rollout server one rank in the weight-sync group; with tensor (or pipeline)
parallelism every worker of the engine would join under that same rank. ``check_weight_group`` says so (the
engine can call it at startup with its config), and the worker refuses such a plan in ``tether_prepare``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout_server.engines import vllm_worker
from rollout_server.engines.vllm_worker import WeightSyncWorker
from tether.config import TetherConfig
from tether.v1 import control_pb2
from weight_sync.buckets import plan_layout


@pytest.mark.parametrize("transport", ["nccl", "gloo"])
def test_a_collective_transport_is_refused_for_an_engine_of_several_workers(transport: str) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2.*filesystem or store"):
        vllm_worker.check_weight_group(transport, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="2 workers"):
        vllm_worker.check_weight_group(transport, tensor_parallel_size=1, pipeline_parallel_size=2)
    vllm_worker.check_weight_group(transport, tensor_parallel_size=1)


@pytest.mark.parametrize("transport", ["filesystem", "store", "nccl"])
def test_transports_each_worker_reads_alone_serve_any_parallelism(transport: str) -> None:
    """What the engine checks at startup, from the transport's declared ``collective``."""
    cfg = TetherConfig.model_validate({"model": {"path": "m"}, "weight_sync": {"transport": {"type": transport}}})
    backend = cfg.weight_sync.transport.type if cfg.weight_sync.transport.collective else None
    if transport == "nccl":
        with pytest.raises(ValueError, match="tensor_parallel_size 4"):
            vllm_worker.check_weight_group(backend, tensor_parallel_size=4, pipeline_parallel_size=2)
    else:
        vllm_worker.check_weight_group(backend, tensor_parallel_size=4, pipeline_parallel_size=2)


class _Worker(WeightSyncWorker):
    """The mixin as vLLM would host it, with only what ``tether_prepare`` reads."""

    def __init__(self, tensor_parallel_size: int) -> None:
        parallel = SimpleNamespace(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=1)
        self.vllm_config = SimpleNamespace(parallel_config=parallel)
        self.device = torch.device("cpu")


def _plan(**source: object) -> bytes:
    layout = plan_layout([("w", torch.float32, (4,))], bucket_size_bytes=1 << 10)
    return control_pb2.WeightUpdatePlan(
        version=1, update_id="u1", tensors=layout.tensors, buckets=layout.buckets, **source
    ).SerializeToString()


def test_a_tensor_parallel_worker_refuses_a_collective_plan_before_joining() -> None:
    worker = _Worker(tensor_parallel_size=2)
    # Nothing listens there: a worker that went on to join would only fail later, in its receive thread.
    source = control_pb2.CollectiveSource(
        backend="gloo", init_method="tcp://127.0.0.1:1", world_size=2, rank=1, group_epoch=1
    )
    try:
        with pytest.raises(ValueError, match="every worker would join under it"):
            worker.tether_prepare(_plan(collective=source), 1.0, 0.5)
        assert not worker._tether_inbox()._pending, "the refused update was started anyway"
    finally:
        worker._tether_inbox().close()


def test_a_tensor_parallel_worker_takes_a_snapshot_plan(tmp_path) -> None:  # type: ignore[no-untyped-def]
    worker = _Worker(tensor_parallel_size=2)
    try:
        assert worker.tether_prepare(_plan(filesystem=control_pb2.FilesystemSource(path=str(tmp_path))), 1.0, 0.5)
    finally:
        worker._tether_inbox().close()
