"""A collective update in the publish dtype, streamed into the loader bucket by bucket: at most two buckets live.

The vLLM worker loads an update as it arrives (``Inbox.stream``) instead of receiving the whole model into
buffers first (float32, on top of vLLM's share of the GPU: ~28 GB more for a 7B model). Here a learner
process sends over gloo and this process streams: every receive buffer is counted while its memory lives
(its storage: views handed to the loader keep it alive), and the peak must stay within two buckets while
the update spans several. The sender's side: a float32 model publishes bfloat16 buckets when
``weight_sync.publish_dtype`` says so, and a receiver ends up with exactly the bf16-rounded weights.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.v1 import control_pb2
from weight_sync.buckets import plan_layout

NUMEL = 64 << 10  # bf16: 128 KiB a tensor
TENSORS = 12
BUCKET_BYTES = 4 * NUMEL * 2  # four tensors a bucket: three buckets
LIMIT_S = 120.0


def _values(i: int) -> torch.Tensor:
    return (torch.arange(NUMEL, dtype=torch.float32) * 1e-3 + i).to(torch.bfloat16)


def _layout():  # type: ignore[no-untyped-def]
    return plan_layout(
        [(f"layer{i}.weight", torch.bfloat16, (NUMEL,)) for i in range(TENSORS)], bucket_size_bytes=BUCKET_BYTES
    )


def _bucket_sender(conn: Any) -> None:
    """Learner rank 0 over gloo: packs each bucket and sends it, as the weight sender does."""
    from tether.config.weight_sync import GlooTransport
    from weight_sync.buckets import empty_bucket, pack_into
    from weight_sync.transport import CollectiveSender

    sender = CollectiveSender(GlooTransport(master_addr="127.0.0.1", master_port=0), timeout_s=30)
    sender.inflight_bytes = 2 * BUCKET_BYTES
    conn.send(sender.sources(["receiver"], version=1)["receiver"]["collective"].SerializeToString())
    update_id = conn.recv()
    report: dict = {"began": sender.begin(update_id, ["receiver"])}
    layout = _layout()
    members = layout.bucket_members()
    for bucket, metas in zip(layout.buckets, members, strict=True):
        flat = empty_bucket(bucket)
        for meta in metas:
            pack_into(flat, meta, _values(int(meta.name.removeprefix("layer").split(".")[0])))
        sender.send(flat)
    report["delivered"] = sender.finish()
    sender.close()
    conn.send(report)
    conn.close()


class _LiveBuckets:
    """Receive buffers alive at any moment (bytes), and the peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.allocated = 0
        self._lock = threading.Lock()

    def track(self, bucket: control_pb2.Bucket, device: torch.device | str = "cpu") -> torch.Tensor:
        flat = torch.empty(int(bucket.num_bytes), dtype=torch.uint8, device=device)
        with self._lock:
            self.live += flat.numel()
            self.peak = max(self.peak, self.live)
            self.allocated += 1
        weakref.finalize(flat.untyped_storage(), self._free, flat.numel())  # the memory (views keep it, not the tensor)
        return flat

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


def test_a_streamed_update_holds_at_most_two_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    import weight_sync.collective as collective
    from weight_sync.inbox import Inbox, Timeouts

    live = _LiveBuckets()
    monkeypatch.setattr(collective, "empty_bucket", live.track)
    layout = _layout()
    assert len(layout.buckets) == 3
    model = {f"layer{i}.weight": torch.zeros(NUMEL, dtype=torch.bfloat16) for i in range(TENSORS)}
    seen: list[tuple[str, torch.dtype, int]] = []

    def load(named: Any) -> dict:
        for name, tensor in named:  # a loader that copies each tensor into the model, as load_weights does
            seen.append((name, tensor.dtype, live.live))
            model[name].copy_(tensor)
        return {"loaded": len(seen)}

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_bucket_sender, args=(child,), daemon=True)
    proc.start()
    inbox = Inbox()
    try:
        assert conn.poll(LIMIT_S)
        source = control_pb2.CollectiveSource.FromString(conn.recv())
        plan = control_pb2.WeightUpdatePlan(
            version=1, update_id="u-stream", tensors=layout.tensors, buckets=layout.buckets, collective=source
        )
        inbox.stream(plan, device=None, timeouts=Timeouts(transfer_s=30, go_s=60), consume=load)
        conn.send("u-stream")
        assert inbox.take_streamed("u-stream", timeout_s=LIMIT_S) == {"loaded": TENSORS}
        assert conn.poll(LIMIT_S)
        assert conn.recv() == {"began": True, "delivered": True}
    finally:
        inbox.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert [name for name, _, _ in seen] == [f"layer{i}.weight" for i in range(TENSORS)]
    assert {dtype for _, dtype, _ in seen} == {torch.bfloat16}
    for i in range(TENSORS):
        torch.testing.assert_close(model[f"layer{i}.weight"], _values(i), rtol=0, atol=0)
    assert live.allocated == 3
    assert live.peak <= 2 * BUCKET_BYTES, f"peak {live.peak} bytes of receive buffers, over two buckets"
    assert max(at for _, _, at in seen) <= 2 * BUCKET_BYTES


def test_a_float32_learner_publishes_bfloat16_buckets_over_gloo(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.integration.test_weight_sync_gloo import Fleet
    from tests.weight_receiver import ModelEngine
    from tether.commands.tiny_model import make_tiny_model
    from tether.config import TetherConfig
    from weight_sync.sender import WeightSender

    cfg = TetherConfig.model_validate(
        {
            "run": {"run_id": "ws-bf16", "output_dir": str(tmp_path)},
            "weight_sync": {
                "transport": {"type": "gloo", "master_port": 0},
                "publish_dtype": "bfloat16",
                "verify_checksums": True,
                "snapshot_every": 0,
            },
        }
    )
    learner = ModelEngine.from_path(make_tiny_model(tmp_path / "learner", seed=3)).model
    assert {p.dtype for p in learner.parameters()} == {torch.float32}
    fleet = Fleet()
    try:
        address = fleet.add(tiny_model_dir, cfg)
        sender = WeightSender(cfg, model=learner, servers=[address])
        try:
            assert {meta.dtype for meta in sender.layout.tensors} == {"bfloat16"}
            metrics = sender.publish(1)
            assert metrics["weight_sync/reached"] == 1, sender.last_dropped
            assert metrics["weight_sync/bytes"] == sum(p.numel() * 2 for p in learner.parameters())
        finally:
            sender.close()
        received = dict(fleet.engines[0].model.named_parameters())
        for name, param in learner.named_parameters():
            expected = param.detach().to(torch.bfloat16).to(received[name].dtype)
            torch.testing.assert_close(received[name].detach(), expected, rtol=0, atol=0)
    finally:
        fleet.close()
