"""The learner's side of a weight update: gather from FSDP2 shards, pack, send, run the handshake.

``WeightSender.publish(version)`` is called on every learner rank because gathering a full tensor from
FSDP2 shards (``DTensor.full_tensor()``) is a collective of the learner's own group. Tensors are gathered
one parameter at a time in a fixed order, so at most one bucket per dtype (plus two buckets' worth of
bytes in flight) is ever materialised on rank 0 — never the whole model. A collective transport sends
floating tensors in ``weight_sync.publish_dtype`` (``auto``: the engines' dtype; bf16 on GPU), cast one
tensor at a time as gathered. Rank 0 alone talks to rollout servers:

    prepare (gRPC, all servers at once, deadline) → begin (group ready?) → gather + send each segment as
    soon as it is complete (async broadcast handles) and write snapshot shards → finish (wait the
    handles) → commit (gRPC, deadline) → report

A bucket travels as segments (``buckets.plan_segments``): a tensor of at least ``direct_tensor_mb`` is
broadcast as gathered, straight from its own memory into its place in the receivers' bucket, so the
learner never copies it; runs of smaller tensors are packed into a pool slot and sent from there. A
snapshot due on this update needs whole buckets, so then every tensor is packed (and sent from the slot).

A server that errs or misses a deadline is dropped from this update and the learner carries on; it
catches up from the snapshot (``WeightReceiver.catch_up`` / its commit fallback) or at the next update.
Rank 0 first tells the other ranks (one broadcast on the learner's group) whether a gather is needed at
all, so an update with no live server and no snapshot due costs nothing.

Off the critical path (``publish(v, background=True)``, what the learner does when the staleness bound
allows it): every rank gathers and rank 0 packs the whole update into staged buckets — the only part
that reads the model, so the next optimizer step may change it right after — and a thread of rank 0
then runs the handshake, transfer and snapshot from those buckets while the learner trains on. The
price is one model's worth of staged buckets on rank 0. One publication is in flight at a time
(``wait()`` before the next), so versions reach every server in order.

    sender = WeightSender(cfg, model=fsdp_model, rank=rank, world_size=world, registry=registry)
    metrics = sender.publish(version)   # on every rank; rank 0 returns weight_sync/* metrics
    sender.publish(version, background=True); ...; metrics = sender.wait()
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.v1 import control_pb2
from weight_sync.buckets import (
    BufferPool,
    Segment,
    as_bytes,
    bucket_ready_order,
    checksum,
    dtype_from_name,
    pack_into,
    plan_layout,
    plan_segments,
)
from weight_sync.handshake import ControlClients, PendingCalls, abort_all
from weight_sync.loading import inflight_message
from weight_sync.publication import Deliver, WeightPublisher, params_device, publish_dtype
from weight_sync.snapshot import SnapshotWriter, snapshot_root
from weight_sync.transport import make_sender_transport

log = get_logger(__name__)


class WeightSender(WeightPublisher):
    def __init__(
        self,
        cfg: TetherConfig,
        *,
        model: torch.nn.Module,
        params: Sequence[tuple[str, torch.Tensor]] | None = None,
        rank: int = 0,
        world_size: int = 1,
        registry: object | None = None,
        servers: Sequence[str] | Callable[[], Sequence[str]] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``registry`` (a ``buffer.ServerRegistry``) or ``servers`` (addresses, or a callable returning them)
        names the receivers; ``process_group`` is the learner group the shards live on (default: torchrun's);
        ``params``: the named tensors an update sends (default: all of ``model``'s; LoRA: the adapters)."""
        super().__init__(cfg, model=model, params=params, rank=rank, world_size=world_size)
        self.registry, self.servers = registry, servers
        self.process_group = process_group
        # A collective push sends floating tensors in the publish dtype; None: as they are (a filesystem
        # snapshot keeps the learner's exact weights).
        self.publish_dtype = (
            dtype_from_name(publish_dtype(cfg, params_device(self._params)))
            if cfg.weight_sync.transport.collective
            else None
        )
        metas = [(name, self._on_wire(p.dtype), tuple(p.shape)) for name, p in self._params]
        self.layout = plan_layout(metas, bucket_size_bytes=max(1, int(self.wcfg.bucket_size_mb * 2**20)))
        self._last_member = bucket_ready_order(self.layout)
        self.last_checksums: dict[str, float] = {}
        self.on_bucket: Callable[[int, int], None] | None = None
        """Progress hook on rank 0: ``(bucket index, bucket count)`` after each bucket is handed off."""
        if rank == 0:
            # Where snapshots go; written on schedule (``snapshot_every``, the filesystem transport) or on
            # demand (``publish(..., snapshot=True)``: a resumed learner's first publication).
            try:
                self.snapshot_root: Path | None = snapshot_root(cfg)
            except ValueError:  # no run id (a sender driven by hand): nowhere to write snapshots
                self.snapshot_root = None
            self.transport = make_sender_transport(self.wcfg, snapshot_root=self.snapshot_root)
            # The layout is fixed for the sender's life, so its bucket buffers are too (see BufferPool).
            capacity = max((b.num_bytes for b in self.layout.buckets), default=0)
            self.pool = BufferPool(capacity, self.transport.device)
            self.transport.inflight_bytes = 2 * capacity  # one bucket's worth on the wire while the next fills
            self.segments = plan_segments(self.layout, min_bytes=self.transport.segment_min_bytes)
            self._segment_of = {i: segment for segment in self.segments for i in segment.members}
            # One token for both sides: the servers require rollout.auth_token, else TETHER_AUTH_TOKEN,
            # so the learner resolves it with the servers' own function rather than a second setting.
            from tether.auth import auth_token

            self.clients = ControlClients(token=auth_token(cfg.rollout.auth_token) or None)

    def _on_wire(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter of ``dtype`` travels in (floating ones: the publish dtype, when set)."""
        return self.publish_dtype if self.publish_dtype is not None and dtype.is_floating_point else dtype

    def _live_servers(self) -> list[str]:
        if self.registry is not None:
            return sorted({info.address for info in self.registry.live()})
        if callable(self.servers):
            return list(self.servers())
        return list(self.servers or [])

    def _stage(self, version: int, *, snapshot: bool, background: bool, start: float) -> Deliver | None:
        """Push the model's current weights as ``version`` to every live server; ``snapshot`` also writes
        them as that version's filesystem snapshot, whatever the schedule. In the background every rank
        gathers and rank 0 packs the whole update into staged buckets now; otherwise tensors are gathered
        as the transfer sends them."""
        if self.rank != 0:
            if self._agree(False):
                self._gather(None)
            return None
        servers = self._live_servers()
        self.clients.forget(servers)
        snapshot_due = (
            snapshot
            or self.transport.needs_snapshot
            or (self.wcfg.snapshot_every > 0 and version % self.wcfg.snapshot_every == 0)
        )
        if snapshot_due and self.snapshot_root is None:
            raise ValueError("weight_sync: a snapshot is due but run.run_id is empty (no run folder to write it to)")
        staged: list[torch.Tensor] | None = None
        if background:
            staged = []
            if self._agree(bool(servers) or snapshot_due):
                staged = self._pack_all()
                if self.transport.device.type == "cuda":  # packed on this thread's stream; sent from another
                    torch.cuda.current_stream().synchronize()
        return functools.partial(self._deliver, version, servers, snapshot_due, staged, start)

    def _deliver(
        self,
        version: int,
        servers: list[str],
        snapshot_due: bool,
        staged: list[torch.Tensor] | None,
        start: float,
        on_done: Callable[[dict[str, float]], None] | None = None,
    ) -> dict[str, float]:
        """Rank 0: prepare → begin → send (gathering now when ``staged`` is None, else the staged buckets)
        → snapshot → commit → metrics.

        A transport whose receivers do not join a group (the filesystem snapshot: each reads on its own at
        commit) needs no answer before the bytes are written, so its Prepare round trip runs while the
        snapshot is written instead of before it (a tenth of a demo step in sync mode).
        """
        if staged is not None and self.transport.device.type == "cuda":
            torch.cuda.set_device(self.transport.device)  # the current device is per thread
        update_id = f"v{version}-{uuid.uuid4().hex[:12]}"
        dropped: dict[str, str] = {}
        ready, overlapped = self._start_prepare(servers, version, update_id, dropped)
        prepare_s = time.perf_counter() - start
        ready, sending = self._begin(ready, update_id, dropped)
        snapshot = SnapshotWriter(self.snapshot_root, version, self.layout) if snapshot_due else None
        gather_start = time.perf_counter()
        transfer_ok = self._transfer(version, ready, sending=sending, snapshot=snapshot, staged=staged)
        gather_s = time.perf_counter() - gather_start
        if snapshot is not None:
            snapshot.commit(keep=self.wcfg.keep_snapshots)
        if overlapped is not None:
            ready = self._ready(servers, *overlapped.result(), dropped)
            prepare_s = time.perf_counter() - start
        commit_start = time.perf_counter()
        with spans.span("weight_commit", version=version, servers=",".join(ready)):
            reached = self._commit(ready, version, update_id, transfer_ok, snapshot is not None, dropped)
        seconds = time.perf_counter() - start
        self.last_dropped = dropped
        metrics = {
            "weight_sync/version": float(version),
            "weight_sync/bytes": float(self.layout.num_bytes),
            "weight_sync/seconds": seconds,
            "weight_sync/reached": float(reached),
            "weight_sync/dropped": float(len(dropped)),
            "weight_sync/prepare_seconds": prepare_s,
            "weight_sync/transfer_seconds": gather_s,
            "weight_sync/commit_seconds": seconds - (commit_start - start),
            "weight_sync/group_rebuild_seconds": getattr(self.transport, "rebuild_seconds", 0.0),
            "weight_sync/snapshot": float(snapshot is not None),
            "weight_sync/background": float(staged is not None),
        }
        log.info("weights_published", version=version, servers=len(servers), reached=reached,
                 dropped=sorted(dropped), bytes=self.layout.num_bytes, seconds=round(seconds, 3),
                 background=staged is not None)  # fmt: skip
        if on_done is not None:
            on_done(metrics)
        return metrics

    def _start_prepare(
        self, servers: list[str], version: int, update_id: str, dropped: dict[str, str]
    ) -> tuple[list[str], PendingCalls | None]:
        """The servers ready for this update and, for a transport whose receivers join no group, the Prepare
        calls still in flight (all ``servers`` count as ready until their answers are read, before commit)."""
        if servers and not self.transport.joins_receivers:
            overlapped = self.clients.start_all(
                "PrepareWeightUpdate", self._plans(servers, version, update_id),
                timeout_s=self.wcfg.prepare_timeout_s, stage="prepare",
            )  # fmt: skip
            return list(servers), overlapped
        with spans.span("weight_prepare", version=version, servers=len(servers)):
            return (self._prepare(servers, version, update_id, dropped) if servers else []), None

    def _begin(self, ready: list[str], update_id: str, dropped: dict[str, str]) -> tuple[list[str], bool]:
        """Open the transfer to the ready servers: (the servers still ready, whether bytes are sent). A group
        that cannot be built aborts the update on all of them."""
        sending = bool(ready) and self.transport.begin(update_id, ready)
        if ready and not sending:
            abort_all(self.clients, ready, update_id=update_id, reason="transfer group failed", timeout_s=5.0)
            dropped.update(dict.fromkeys(ready, "transfer group could not be built"))
            ready = []
        return ready, sending

    def _transfer(
        self,
        version: int,
        ready: list[str],
        *,
        sending: bool,
        snapshot: SnapshotWriter | None,
        staged: list[torch.Tensor] | None,
    ) -> bool:
        """Send every segment (and write the snapshot's buckets); whether the transport delivered them all.
        A failure discards the half-written snapshot."""
        with spans.span("weight_transfer", version=version, servers=len(ready), snapshot=snapshot is not None):
            try:
                if staged is not None:
                    self._send_all(sending=sending, snapshot=snapshot, staged=staged)
                elif self._agree(sending or snapshot is not None):
                    self._send_all(sending=sending, snapshot=snapshot, staged=None)
            except BaseException:
                if snapshot is not None:
                    snapshot.discard()
                raise
            return self.transport.finish() if sending else False

    def _agree(self, gather: bool) -> bool:
        """Rank 0 tells every learner rank whether this update gathers (one tiny broadcast)."""
        if self.world_size <= 1 or not dist.is_initialized():
            return gather
        backend = dist.get_backend(self.process_group)
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
        flag = torch.tensor([int(gather)], device=device)
        dist.broadcast(
            flag, src=dist.get_global_rank(self.process_group, 0) if self.process_group else 0, group=self.process_group
        )
        return bool(flag.item())

    def _plans(self, servers: Sequence[str], version: int, update_id: str) -> dict[str, control_pb2.WeightUpdatePlan]:
        sources = self.transport.sources(servers, version=version)
        return {
            s: control_pb2.WeightUpdatePlan(
                version=version,
                tensors=self.layout.tensors,
                buckets=self.layout.buckets,
                inflight=inflight_message(self.wcfg.inflight),
                update_id=update_id,
                **sources[s],
            )
            for s in servers
        }

    @staticmethod
    def _ready(candidates: list[str], responses: dict, errors: dict[str, str], dropped: dict[str, str]) -> list[str]:
        """The candidates that answered Prepare ready; the others go to ``dropped`` with why."""
        dropped.update(errors)
        for s in candidates:
            if s in responses and not responses[s].ready:
                dropped[s] = f"declined (at version {responses[s].current_version})"
        return [s for s in candidates if s in responses and responses[s].ready]

    def _prepare(self, servers: list[str], version: int, update_id: str, dropped: dict[str, str]) -> list[str]:
        """Ready servers of a transport they join (a collective). Its group needs exactly its planned
        members, so when some fail the survivors are planned again once under a new epoch (still one update)."""
        candidates = servers
        for _ in range(2):
            plans = self._plans(candidates, version, update_id)
            responses, errors = self.clients.call_all(
                "PrepareWeightUpdate", plans, timeout_s=self.wcfg.prepare_timeout_s, stage="prepare"
            )
            ready = self._ready(candidates, responses, errors, dropped)
            if len(ready) == len(candidates) or not ready:
                return ready
            self.transport.begin(update_id, ready)  # members differ: releases the waiting ones with "0"
            candidates = ready
        abort_all(self.clients, candidates, update_id=update_id, reason="membership kept changing", timeout_s=5.0)
        dropped.update(dict.fromkeys(candidates, "membership kept changing during prepare"))
        return []

    @torch.no_grad()
    def _gather(self, on_tensor: Callable[[int, torch.Tensor], None] | None) -> None:
        """Gather parameter by parameter (every rank); rank 0 hands each whole tensor to ``on_tensor(i, full)``."""
        checksums: dict[str, float] = {}
        for i, (name, param) in enumerate(self._params):
            full = full_tensor(param).detach()  # a collective on all ranks when the parameter is sharded
            if self.rank != 0 or on_tensor is None:
                continue
            if full.dtype != self._on_wire(full.dtype):  # one tensor at a time: the cast is transient
                full = full.to(self._on_wire(full.dtype))
            if self.wcfg.verify_checksums:
                checksums[name] = checksum(full)
            on_tensor(i, full)
            del full
        self.last_checksums = checksums

    def _pack_all(self) -> list[torch.Tensor]:
        """Gather and pack the whole update into pool slots (one per bucket, in bucket order)."""
        slots: dict[int, torch.Tensor] = {}
        staged: list[torch.Tensor] = []

        def pack(i: int, full: torch.Tensor) -> None:
            meta = self.layout.tensors[i]
            if meta.bucket not in slots:
                slots[meta.bucket] = self.pool.take(self.layout.buckets[meta.bucket].num_bytes)
            slot = slots[meta.bucket]
            pack_into(slot[: self.layout.buckets[meta.bucket].num_bytes], meta, full)
            if self._last_member[meta.bucket] == i:
                staged.append(slots.pop(meta.bucket))

        self._gather(pack)
        return staged

    def _send_all(self, *, sending: bool, snapshot: SnapshotWriter | None, staged: list[torch.Tensor] | None) -> None:
        """Rank 0: every segment to the transport in plan order, every complete bucket to the snapshot.

        A tensor of a direct segment is broadcast as gathered (no copy) unless a snapshot needs the whole
        bucket; the rest are packed into a pool slot, sent from there segment by segment. A slot goes
        back to the pool once its bucket is complete (snapshot shard written) and no broadcast reads it;
        ``staged`` (a background publication) holds every bucket packed already.
        """
        slots = dict(enumerate(staged)) if staged is not None else {}
        readers = dict.fromkeys(slots, 1)  # per slot: broadcasts still reading it, plus 1 until its bucket is done

        def release(bucket: int) -> None:
            readers[bucket] -= 1
            if readers[bucket] == 0:
                del readers[bucket]
                self.pool.give(slots.pop(bucket))

        def bucket_bytes(bucket: int) -> torch.Tensor:
            if bucket not in slots:
                slots[bucket], readers[bucket] = self.pool.take(self.layout.buckets[bucket].num_bytes), 1
            return slots[bucket][: self.layout.buckets[bucket].num_bytes]

        def on_tensor(i: int, full: torch.Tensor | None) -> None:
            meta = self.layout.tensors[i]
            segment: Segment = self._segment_of[i]
            source = None
            if full is not None:
                if sending and segment.direct and snapshot is None and _sendable(full, self.transport.device):
                    source = as_bytes(meta, full)
                else:
                    pack_into(bucket_bytes(meta.bucket), meta, full)
            if sending and segment.members[-1] == i:
                if source is not None:
                    self.transport.send(source)
                else:
                    readers[meta.bucket] += 1
                    chunk = bucket_bytes(meta.bucket)[segment.start : segment.end]
                    self.transport.send(chunk, on_done=lambda b=meta.bucket: release(b))
            if self._last_member[meta.bucket] == i:
                if snapshot is not None:
                    snapshot.write_bucket(meta.bucket, bucket_bytes(meta.bucket))
                if meta.bucket in slots:
                    release(meta.bucket)
                if self.on_bucket is not None:
                    self.on_bucket(meta.bucket, len(self.layout.buckets))

        if staged is None:
            self._gather(on_tensor)
        else:
            for i in range(len(self.layout.tensors)):
                on_tensor(i, None)

    def _commit(
        self, ready: list[str], version: int, update_id: str, transfer_ok: bool, snapshot: bool, dropped: dict[str, str]
    ) -> int:
        if not ready:
            return 0
        if not transfer_ok and not snapshot:
            abort_all(self.clients, ready, update_id=update_id, reason="transfer failed", timeout_s=5.0)
            dropped.update(dict.fromkeys(ready, "transfer failed and no snapshot to fall back on"))
            return 0
        # After a failed transfer the survivors still commit: they load this version's snapshot instead.
        request = control_pb2.CommitWeightUpdateRequest(update_id=update_id, version=version)
        responses, errors = self.clients.call_all(
            "CommitWeightUpdate", dict.fromkeys(ready, request), timeout_s=self.wcfg.commit_timeout_s, stage="commit"
        )
        dropped.update(errors)
        reached = 0
        for server, response in responses.items():
            if response.policy_version != version:
                dropped[server] = f"committed but reports version {response.policy_version}"
                continue
            bad = [
                n
                for n, v in response.checksums.items()
                if not math.isclose(self.last_checksums.get(n, v), v, rel_tol=1e-9)
            ]
            if bad:
                dropped[server] = f"checksum mismatch on {len(bad)} tensors (first: {bad[0]})"
                log.error("weight_sync_checksum_mismatch", server=server, tensors=bad[:5])
                continue
            reached += 1
        return reached

    def _close(self) -> None:
        if self.rank == 0:
            self.transport.close()
            self.clients.close()


def _sendable(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether the transport can broadcast ``tensor``'s own memory (else it is packed into a bucket first)."""
    return tensor.is_contiguous() and tensor.device == device


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter. On a one-rank mesh the local shard already is (no all-gather, no DTensor
    dispatch: at the demo size that was most of the sender's time on the learner's critical path)."""
    if not isinstance(param, DTensor):
        return param
    local = param.to_local()
    if param.device_mesh.size() == 1 and local.shape == param.shape:
        return local
    return param.full_tensor()
