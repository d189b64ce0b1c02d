"""A weight-sync peer that stops answering mid-update: the survivor's stage deadline fires and it lives on.

Real processes over gloo, with the group's work handles made to behave as NCCL's do (:class:`NcclLikeWork`:
``wait()`` returns at once, as NCCL's only orders a CUDA stream; ``is_completed()`` tells the truth). That is
the behaviour under which tether's deadlines used to never fire: the learner's ``finish()`` reported a
transfer to a frozen receiver as delivered, and a receiver whose learner froze handed its half-received
buffers to the loader. The frozen peer is SIGSTOPped — dead to the wire without closing its sockets, as a
crashed host or a hung GPU is (a closed socket would fail the broadcast at once, deadline or not).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

from tether.v1 import control_pb2

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="freezes a peer with SIGSTOP")

NUMEL = 16 << 20  # 64 MB of float32: far more than loopback's socket buffers hold, so a frozen peer blocks it
DEADLINE_S = 2.0
LIMIT_S = 120.0
"""A guard against a hang (a deadline that never fires), not a timing check."""


class NcclLikeWork:
    """A gloo work handle with NCCL's ``wait()``: returns at once unless the work already completed."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout: Any = None) -> bool:
        if self._work.is_completed():
            return self._work.wait()
        return True


class NcclLikeGroup:
    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> NcclLikeWork:
        return NcclLikeWork(self._pg.broadcast(tensors, opts))

    def __getattr__(self, name: str) -> Any:  # abort, shutdown, ...
        return getattr(self._pg, name)


def _nccl_like_works() -> None:
    """In this process, every weight-sync group hands out NCCL-like work handles."""
    import weight_sync.collective as collective
    import weight_sync.transport as transport

    build = collective.build_group

    def build_group(**kwargs: Any) -> NcclLikeGroup:
        return NcclLikeGroup(build(**kwargs))

    collective.build_group = build_group
    transport.build_group = build_group


def _plan(source: bytes, update_id: str) -> control_pb2.WeightUpdatePlan:
    from weight_sync.buckets import plan_layout

    layout = plan_layout([("w", torch.float32, (NUMEL,))], bucket_size_bytes=NUMEL * 4)
    return control_pb2.WeightUpdatePlan(
        version=1,
        update_id=update_id,
        tensors=layout.tensors,
        buckets=layout.buckets,
        collective=control_pb2.CollectiveSource.FromString(source),
    )


def _sender(conn: Any, freeze_after_join: bool) -> None:
    """Learner rank 0: plan one receiver, build the group; then send (or freeze itself, mid-update)."""
    _nccl_like_works()
    from tether.config.weight_sync import GlooTransport
    from weight_sync.transport import CollectiveSender

    report: dict = {}
    sender = CollectiveSender(GlooTransport(master_addr="127.0.0.1", master_port=0), timeout_s=DEADLINE_S)
    source = sender.sources(["receiver"], version=1)["receiver"]["collective"]
    conn.send(source.SerializeToString())
    update_id = conn.recv()
    report["began"] = sender.begin(update_id, ["receiver"])
    conn.send(report)
    if freeze_after_join:
        os.kill(os.getpid(), signal.SIGSTOP)  # the learner stops answering before it sends a byte
    conn.recv()  # the receiver is frozen now
    sender.send(torch.ones(NUMEL))
    start = time.monotonic()
    report["delivered"] = sender.finish()
    report["seconds"] = time.monotonic() - start
    report["alive"] = bool(torch.ones(4).sum().item() == 4)  # this process carries on
    conn.send(report)
    conn.close()
    os._exit(0)  # a gloo worker may still be blocked on the frozen peer


def _receiver(conn: Any, source: bytes, update_id: str, transfer_s: float) -> None:
    """A rollout server's receive (the inbox the vLLM worker also runs): started at Prepare, taken at Commit."""
    _nccl_like_works()
    from weight_sync.inbox import Inbox, Timeouts

    report: dict = {}
    inbox = Inbox()
    inbox.start(_plan(source, update_id), device=None, timeouts=Timeouts(transfer_s=transfer_s, go_s=60))
    conn.send({"started": True})
    start = time.monotonic()
    try:
        _, incoming = inbox.take(update_id, timeout_s=LIMIT_S)
        report["took"] = [name for name, _ in incoming.named]
    except Exception as exc:
        report["error"] = repr(exc)
    report["seconds"] = time.monotonic() - start
    report["alive"] = bool(torch.ones(4).sum().item() == 4)
    conn.send(report)
    conn.close()
    os._exit(0)


def _recv(conn: Any, who: str) -> Any:
    if not conn.poll(LIMIT_S):
        pytest.fail(f"{who}: no answer within {LIMIT_S:g}s")
    return conn.recv()


def _stop(*procs: Any) -> None:
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def test_a_frozen_receiver_fails_the_senders_transfer_at_its_deadline() -> None:
    ctx = mp.get_context("spawn")
    s_conn, s_child = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(s_child, False), daemon=True)
    sender.start()
    receiver = None
    try:
        source = _recv(s_conn, "sender")
        r_conn, r_child = ctx.Pipe()
        # The receiver's own deadline is far off: only the sender's can end this.
        receiver = ctx.Process(target=_receiver, args=(r_child, source, "u-frozen-receiver", LIMIT_S), daemon=True)
        receiver.start()
        assert _recv(r_conn, "receiver")["started"]
        s_conn.send("u-frozen-receiver")
        assert _recv(s_conn, "sender")["began"] is True
        os.kill(receiver.pid, signal.SIGSTOP)  # joined, then dead to the wire
        s_conn.send("go")
        report = _recv(s_conn, "sender")
        assert report["delivered"] is False, f"the sender reported a transfer to a frozen receiver delivered: {report}"
        assert report["alive"] is True
        sender.join(LIMIT_S)
        assert sender.exitcode == 0, f"the sender exited with {sender.exitcode}"
    finally:
        _stop(sender, *([receiver] if receiver is not None else []))


def test_a_frozen_sender_fails_the_receivers_transfer_at_its_deadline() -> None:
    ctx = mp.get_context("spawn")
    s_conn, s_child = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(s_child, True), daemon=True)
    sender.start()
    receiver = None
    try:
        source = _recv(s_conn, "sender")
        r_conn, r_child = ctx.Pipe()
        receiver = ctx.Process(target=_receiver, args=(r_child, source, "u-frozen-sender", DEADLINE_S), daemon=True)
        receiver.start()
        assert _recv(r_conn, "receiver")["started"]
        s_conn.send("u-frozen-sender")
        assert _recv(s_conn, "sender")["began"] is True  # then it stops itself before sending
        report = _recv(r_conn, "receiver")
        assert "took" not in report, f"the receiver took an update its frozen sender never sent: {report}"
        assert "StageTimeout" in report["error"] or "imed out" in report["error"], report
        assert report["alive"] is True
        receiver.join(LIMIT_S)
        assert receiver.exitcode == 0, f"the receiver exited with {receiver.exitcode}"
    finally:
        _stop(sender, *([receiver] if receiver is not None else []))
