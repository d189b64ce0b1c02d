"""The sender's end of each transport behind one small interface, and the factory that picks one.

A transport answers four questions for learner rank 0: what each receiver's plan says about where the
bytes come from (``sources``), whether the transfer may start once the ready receivers are known
(``begin``), how a full bucket leaves (``send``, asynchronous), and whether everything arrived in time
(``finish``). Packing, gathering and the gRPC handshake are the same for all transports and live in
``sender.py``; the receiver's end picks its path from the plan's ``source`` oneof, not from its own
config, so a server never needs to know which transport the learner chose.
"""

from __future__ import annotations

import abc
import collections
import datetime as _dt
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from tether.config.weight_sync import FilesystemTransport, GlooTransport, NcclTransport, WeightSyncConfig
from tether.logs import get_logger
from tether.v1 import control_pb2
from weight_sync.collective import broadcast, build_group, check_backend, close_group, go_key, wait_work
from weight_sync.snapshot import snapshot_dir

log = get_logger(__name__)


class SenderTransport(abc.ABC):
    name: str
    device: torch.device = torch.device("cpu")
    """Where bucket buffers are packed (the GPU for nccl)."""
    needs_snapshot: bool = False
    """The transport *is* the snapshot: write one on every publication."""
    joins_receivers: bool = False
    """Receivers join the transfer as members of a group (a collective): the group must be formed again when
    the ready set differs from the planned one. A transport each receiver reads on its own does not care."""
    segment_min_bytes: int = 0
    """How buckets are cut into broadcasts (``buckets.plan_segments``); 0: whole buckets."""
    inflight_bytes: int = 0
    """At most this many bytes on the wire at once (the sender sets it from its layout)."""

    @abc.abstractmethod
    def sources(self, servers: Sequence[str], *, version: int) -> dict[str, dict]:
        """Per receiver address, its plan's ``source`` field: ``{"collective": ...}`` or ``{"filesystem": ...}``."""

    def begin(self, update_id: str, ready: Sequence[str]) -> bool:
        """The transfer to ``ready`` may start (False: it cannot; the caller aborts the update)."""
        return True

    def send(self, flat: torch.Tensor, *, on_done: Callable[[], None] | None = None) -> None:
        """Start sending the next segment (in ``plan_segments`` order); ``on_done`` runs once the transport
        no longer reads ``flat`` (at once for a transport that does not read it; never when the transfer
        failed, so a buffer that a torn-down group might still touch is never reused)."""
        if on_done is not None:
            on_done()

    def finish(self) -> bool:
        """Wait for everything sent; False when the transfer failed or missed its deadline."""
        return True

    def close(self) -> None:  # noqa: B027
        pass


class FilesystemSender(SenderTransport):
    """The snapshot written during the gather is the transfer; receivers read it at commit."""

    name = "filesystem"
    needs_snapshot = True

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def sources(self, servers: Sequence[str], *, version: int) -> dict[str, dict]:
        path = str(snapshot_dir(self.root, version).resolve())
        return {s: {"filesystem": control_pb2.FilesystemSource(path=path)} for s in servers}


class CollectiveSender(SenderTransport):
    """Rank 0 of a gloo / NCCL group with the receivers; keeps at most ``inflight_bytes`` on the wire
    (but always the segment just sent, so ``send()`` never waits for the bytes it was given)."""

    joins_receivers = True

    def __init__(self, tcfg: GlooTransport | NcclTransport, *, timeout_s: float, segment_min_bytes: int = 0) -> None:
        check_backend(tcfg.type)
        self.name = tcfg.type
        self.device = torch.device("cuda", torch.cuda.current_device()) if tcfg.type == "nccl" else torch.device("cpu")
        self.host = tcfg.master_addr
        self.timeout_s = timeout_s
        self.segment_min_bytes = segment_min_bytes
        self.store = dist.TCPStore(
            tcfg.master_addr,
            tcfg.master_port,
            is_master=True,
            wait_for_workers=False,
            timeout=_dt.timedelta(seconds=timeout_s),
        )
        self.init_method = f"tcp://{tcfg.master_addr}:{self.store.port}"
        self.epoch = 0
        self.members: tuple[str, ...] = ()
        self.pg: dist.ProcessGroup | None = None
        self.rebuild_seconds = 0.0
        self._inflight: collections.deque[tuple[dist.Work, int, Callable[[], None] | None]] = collections.deque()
        self._inflight_now = 0
        self._failed: Exception | None = None

    def sources(self, servers: Sequence[str], *, version: int) -> dict[str, dict]:
        if tuple(servers) != self.members or self.pg is None:
            close_group(self.pg)
            self.pg, self.members = None, tuple(servers)
            self.epoch += 1
        world = len(self.members) + 1
        return {
            s: {
                "collective": control_pb2.CollectiveSource(
                    backend=self.name,
                    init_method=self.init_method,
                    world_size=world,
                    rank=i + 1,
                    group_epoch=self.epoch,
                    src_rank=0,
                    segment_min_bytes=self.segment_min_bytes,
                )
            }
            for i, s in enumerate(self.members)
        }

    def begin(self, update_id: str, ready: Sequence[str]) -> bool:
        self._failed = None
        if not ready or set(ready) != set(self.members):
            self.store.set(go_key(update_id, self.epoch), "0")
            self.members = ()  # the next plan gets a new epoch
            return False
        self.store.set(go_key(update_id, self.epoch), "1")
        if self.pg is None:
            start = time.perf_counter()
            try:
                self.pg = build_group(
                    backend=self.name,
                    store=self.store,
                    rank=0,
                    world_size=len(self.members) + 1,
                    epoch=self.epoch,
                    timeout_s=self.timeout_s,
                    host=self.host,
                    device=self.device if self.device.type == "cuda" else None,
                )
            except Exception as exc:  # a member that said ready died before joining (or never joined)
                log.warning("weight_sync_group_failed", epoch=self.epoch, error=str(exc))
                self.members = ()
                return False
            self.rebuild_seconds = time.perf_counter() - start
            log.info(
                "weight_sync_group_built",
                epoch=self.epoch,
                world=len(self.members) + 1,
                seconds=round(self.rebuild_seconds, 3),
            )
        else:
            self.rebuild_seconds = 0.0
        return True

    def send(self, flat: torch.Tensor, *, on_done: Callable[[], None] | None = None) -> None:
        if self._failed is not None or self.pg is None:
            return
        try:
            # The work handle keeps ``flat`` alive; the caller gathers and packs what comes next while this
            # is on the wire (gloo and NCCL progress on their own threads / streams).
            nbytes = flat.numel() * flat.element_size()
            self._inflight.append((broadcast(self.pg, flat, src=0), nbytes, on_done))
            self._inflight_now += nbytes
            # Bounds the memory held by buffers (and gathered tensors) in flight.
            while len(self._inflight) > 1 and self._inflight_now > self.inflight_bytes:
                self._wait_oldest()
        except Exception as exc:
            self._fail(exc)

    def _wait_oldest(self) -> None:
        work, nbytes, on_done = self._inflight[0]
        # On the CPU, within the deadline (NCCL's own wait() returns at once: a dead receiver would go unseen).
        wait_work(work, timeout_s=self.timeout_s, what=f"weight-sync send (epoch {self.epoch})")
        self._inflight.popleft()
        self._inflight_now -= nbytes
        if on_done is not None:
            on_done()

    def finish(self) -> bool:
        try:
            while self._inflight and self._failed is None:
                self._wait_oldest()
        except Exception as exc:
            self._fail(exc)
        self._inflight.clear()
        self._inflight_now = 0
        return self._failed is None

    def _fail(self, exc: Exception) -> None:
        # A broken or timed-out group is torn down at once so surviving receivers fail fast, and the
        # next update rebuilds it (new epoch) with whoever is still alive.
        log.warning("weight_sync_transfer_failed", epoch=self.epoch, error=str(exc))
        self._failed = exc
        close_group(self.pg)
        self.pg, self.members = None, ()

    def close(self) -> None:
        close_group(self.pg)
        self.pg, self.members = None, ()


def make_sender_transport(cfg: WeightSyncConfig, *, snapshot_root: Path) -> SenderTransport:
    transport = cfg.transport
    if isinstance(transport, FilesystemTransport):
        return FilesystemSender(snapshot_root)
    min_bytes = max(1, int(cfg.direct_tensor_mb * 2**20)) if cfg.direct_tensor_mb > 0 else 0
    return CollectiveSender(transport, timeout_s=cfg.transfer_timeout_s, segment_min_bytes=min_bytes)
