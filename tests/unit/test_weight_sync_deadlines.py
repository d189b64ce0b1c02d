"""What a weight-sync NCCL group is built with, and where its receive thread runs, checked on the CPU.

No NCCL here: ``torch.distributed.ProcessGroupNCCL`` and ``torch.cuda``'s device calls are replaced by
recording stand-ins, so each check fails the way the real one would on a GPU:

* the group is constructed with the watchdog's async error handling off (else a broadcast past the group's
  timeout tears the whole process down: the learner, or vLLM's engine core), and the process' own setting
  comes back afterwards;
* a join that never returns (``ncclCommInitRank`` waiting for a peer that never comes) misses its deadline
  instead of blocking the caller for good, and the half-built group is aborted;
* the receive thread sets its device to the loader's GPU (or the GPU current where the update was started)
  before it builds the group: its own current device is cuda:0, where a second rank is "Duplicate GPU".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

import weight_sync.collective as collective
from tether.v1 import control_pb2
from weight_sync.buckets import plan_layout
from weight_sync.inbox import CollectiveReceiver, Timeouts


class _DoneWork:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: object = None) -> bool:
        return True


class _FakeNccl:
    """Stands in for ``ProcessGroupNCCL``: records the environment its constructor ran under."""

    built: ClassVar[list[dict[str, str | None]]] = []
    aborted: ClassVar[list[_FakeNccl]] = []
    join_blocks = False
    release = threading.Event()

    class Options:
        _timeout = None

    def __init__(self, store: object, rank: int, world_size: int, opts: object) -> None:
        _FakeNccl.built.append({name: os.environ.get(name) for name in collective.NCCL_GROUP_ENV})

    def allreduce(self, tensors: list[torch.Tensor]) -> _DoneWork:
        if _FakeNccl.join_blocks:  # rank 0's ncclCommInitRank, waiting for a peer that never joins
            _FakeNccl.release.wait()
        return _DoneWork()

    def abort(self) -> None:
        _FakeNccl.aborted.append(self)


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_FakeNccl]]:
    _FakeNccl.built, _FakeNccl.aborted, _FakeNccl.join_blocks = [], [], False
    _FakeNccl.release = threading.Event()
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNccl, raising=False)
    monkeypatch.setattr(collective, "check_backend", lambda backend: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    yield _FakeNccl
    _FakeNccl.release.set()  # a blocked join of a failing run ends with the test


def _build(timeout_s: float) -> dist.ProcessGroup:
    return collective.build_group(
        backend="nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=2,
        epoch=1,
        timeout_s=timeout_s,
        host="127.0.0.1",
        device="cpu",  # the probe's tensor; the stand-in moves no bytes
    )


def test_an_nccl_group_is_built_with_async_error_handling_off(
    fake_nccl: type[_FakeNccl], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # torch's default: tear the process down
    monkeypatch.delenv("TORCH_NCCL_ENABLE_MONITORING", raising=False)
    _build(timeout_s=5)
    assert len(fake_nccl.built) == 1
    seen = fake_nccl.built[0]
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0", seen
    assert seen["TORCH_NCCL_ENABLE_MONITORING"] == "0", seen
    assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0", seen
    # Only around the construction: the process' other groups keep their own setting.
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ENABLE_MONITORING" not in os.environ


def test_an_nccl_join_that_never_returns_misses_its_deadline(fake_nccl: type[_FakeNccl]) -> None:
    fake_nccl.join_blocks = True
    outcome: list[BaseException | None] = []

    def build() -> None:
        try:
            _build(timeout_s=0.5)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=build, daemon=True)
    caller.start()
    caller.join(30)  # a guard against a hang, not a timing check
    assert not caller.is_alive(), "build_group blocked its caller on a join that never returns"
    assert outcome and isinstance(outcome[0], collective.StageTimeout), outcome
    assert len(fake_nccl.aborted) == 1, "the half-built group was not aborted"


# --- the receive thread's device -------------------------------------------------------------------------------


class _Devices:
    """``torch.cuda``'s current device, per thread as in CUDA (cuda:0 until a thread sets its own)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.at_build: list[tuple[int, object]] = []

    def set_device(self, device: torch.device | int) -> None:
        self._local.index = device.index if isinstance(device, torch.device) else int(device)

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)


class _RecordingGroup:
    def broadcast(self, tensors: list[torch.Tensor], opts: object) -> _DoneWork:
        return _DoneWork()


@pytest.fixture
def devices(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Devices]:
    devs = _Devices()
    monkeypatch.setattr(torch.cuda, "set_device", devs.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", devs.current_device)

    def build_group(**kwargs: object) -> _RecordingGroup:
        # Where NCCL would put this rank: the thread's current device (and the probe tensor's, when named).
        devs.at_build.append((devs.current_device(), kwargs.get("device")))
        return _RecordingGroup()

    monkeypatch.setattr(collective, "build_group", build_group)
    # The buckets stay on the CPU: no CUDA here.
    monkeypatch.setattr(
        collective, "empty_bucket", lambda bucket, device="cpu": torch.empty(bucket.num_bytes, dtype=torch.uint8)
    )
    yield devs


def _nccl_plan(port: int, update_id: str) -> control_pb2.WeightUpdatePlan:
    layout = plan_layout([("w", torch.float32, (16,))], bucket_size_bytes=1 << 20)
    return control_pb2.WeightUpdatePlan(
        version=1,
        update_id=update_id,
        tensors=layout.tensors,
        buckets=layout.buckets,
        collective=control_pb2.CollectiveSource(
            backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_epoch=1, src_rank=0
        ),
    )


def _receive(device: torch.device | None, update_id: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(collective.go_key(update_id, 1), "1")
    plan = _nccl_plan(store.port, update_id)
    end = CollectiveReceiver()
    try:
        end.start(plan, device=device, timeouts=Timeouts(transfer_s=10, go_s=10))
        incoming = end.take(plan, timeout_s=30)
        assert [name for name, _ in incoming.named] == ["w"]
    finally:
        end.close()


def test_the_receive_thread_joins_on_the_loaders_gpu(devices: _Devices) -> None:
    _receive(torch.device("cuda", 1), "u-loader")
    assert len(devices.at_build) == 1
    current, named = devices.at_build[0]
    assert current == 1, "the receive thread built the group on cuda:0, not the loader's cuda:1"
    assert named is None or torch.device(named) == torch.device("cuda", 1)


def test_the_receive_thread_joins_on_the_gpu_current_where_the_update_started(devices: _Devices) -> None:
    devices.set_device(torch.device("cuda", 1))  # the caller's thread (a server whose loader names no device)
    _receive(None, "u-current")
    current, _ = devices.at_build[0]
    assert current == 1, "the receive thread built the group on its own cuda:0, not the caller's cuda:1"
