"""Collective groups between one learner and N rollout servers, apart from torchrun's default group.

The learner already lives in a torchrun world; rollout servers come and go. So the weight-sync group is
built by hand: learner rank 0 hosts a ``TCPStore`` (its own port, not torchrun's) and every member
constructs ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` directly on a ``PrefixStore`` named after the
group epoch. Nothing here touches ``torch.distributed``'s default group or its registry, so a receiver
dying can never wedge the learner's training collectives. Rank 0 is the sender; receivers are 1..N.

Gloo and NCCL groups cannot shrink or grow, so when membership changes the sender bumps ``group_epoch``
and every member builds a fresh group under a fresh prefix (cost measured in weight_sync/README.md).

The rendezvous is gated by a ``go`` key per (update, epoch): a receiver that answered PrepareWeightUpdate
waits on it, and the sender writes ``1`` only when every planned member is ready (otherwise ``0``, and
the waiting receivers give up at once instead of at a timeout). Every blocking step has a deadline kept on
the CPU: the store wait, the group construction (:func:`build_group`) and each broadcast (:func:`wait_work`).

NCCL needs care for those deadlines to hold (neither default does): its ``work.wait()`` only orders the
current CUDA stream after the collective and returns at once, so a peer that died is never noticed on the
CPU; ``ncclCommInitRank`` blocks its thread until every rank has joined, so a lone sender waits forever;
and a ``ProcessGroupNCCL`` inherits the watchdog's async error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
default: tear the process down), so a collective past the group's timeout kills the learner, or vLLM's
engine core. So a weight-sync NCCL group is built with that handling off (:data:`NCCL_GROUP_ENV`, read by
the group's constructor), joined on a helper thread the caller waits for at most its deadline, and every
wait polls ``work.is_completed()`` against its deadline; a missed deadline aborts the communicator
(:func:`close_group`, itself bounded) and raises :class:`StageTimeout` in a process that carries on. vLLM's
``PyNcclCommunicator`` (what TRL's ``vllm_serve`` uses) avoids the watchdog by calling NCCL itself;
this keeps torch's group, so the learner needs no vLLM.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from tether.logs import get_logger
from weight_sync.buckets import Layout, Segment, empty_bucket, plan_segments, unpack
from weight_sync.loading import PartialUpdate

log = get_logger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}

GLOO_THREADS = 4
"""Worker threads of a weight-sync gloo group (torch's default: 2). An update is a train of asynchronous
broadcasts (one per segment) and gloo runs each on one worker thread from start to finish, so the
threads bound how many segments are on the wire at once. Side by side on the bench's update (busy
2-core box): 1 thread 0.4x the raw broadcast, 2 about 0.7x, 4 and 8 alike at about 0.9x
(weight_sync/README.md, Bandwidth)."""


NCCL_GROUP_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # the watchdog neither aborts nor tears the process down
    "TORCH_NCCL_BLOCKING_WAIT": "0",  # deadlines are polled here; torch's blocking wait would not bound the join
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # no flight-recorder dump (and no kill after it) on a timed-out broadcast
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # the heartbeat monitor kills a process whose watchdog looks stuck
}
"""Environment a weight-sync ``ProcessGroupNCCL`` is constructed under (its constructor reads these). Set
only around the construction (:func:`nccl_group_env`): other groups of the process keep their own."""

CLOSE_WAIT_S = 10.0
"""How long :func:`close_group` waits for an abort before leaving it to finish on its own thread."""

_ENV_LOCK = threading.Lock()


class TransferAborted(RuntimeError):
    """The sender called this update off before the transfer began (a planned member was not ready)."""


class StageTimeout(TimeoutError):
    """A collective step missed its deadline (a peer died or never joined); the group is aborted."""


def _timeout(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=max(0.001, seconds))


def parse_init_method(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"weight-sync init_method {init_method!r}: expected tcp://HOST:PORT")
    return url.hostname, url.port


def check_backend(backend: str) -> None:
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError(
            "weight_sync.transport.type is nccl but this process has no CUDA device (or torch lacks NCCL) "
            "— use transport.type: gloo (CPU) or filesystem"
        )
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown collective backend {backend!r}")


def go_key(update_id: str, epoch: int) -> str:
    return f"go/{update_id}/{epoch}"


@contextlib.contextmanager
def nccl_group_env() -> Iterator[None]:
    """:data:`NCCL_GROUP_ENV` in ``os.environ`` for the duration (one construction at a time), then restored."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in NCCL_GROUP_ENV}
        os.environ.update(NCCL_GROUP_ENV)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def build_group(
    *,
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    epoch: int,
    timeout_s: float,
    host: str,
    device: torch.device | str | None = None,
) -> dist.ProcessGroup:
    """A process group of ``world_size`` on ``store`` under this epoch's prefix; blocks until all join, at
    most ``timeout_s`` (:class:`StageTimeout` after that, the half-built group aborted). ``device``: the GPU
    an NCCL group runs on (default: the calling thread's current one)."""
    check_backend(backend)
    prefixed = dist.PrefixStore(f"tether/weight_sync/epoch{epoch}/", store)
    what = f"weight-sync {backend} group (rank {rank} of {world_size})"
    if backend == "gloo":
        return _build_gloo(prefixed, rank=rank, world_size=world_size, timeout_s=timeout_s, host=host, what=what)
    gpu = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return _build_nccl(prefixed, rank=rank, world_size=world_size, timeout_s=timeout_s, gpu=gpu, what=what)


def _build_gloo(
    store: dist.Store, *, rank: int, world_size: int, timeout_s: float, host: str, what: str
) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timeout(timeout_s)
    opts._devices = [_gloo_device(host)]
    opts._threads = GLOO_THREADS
    # Gloo's constructor bounds its store waits, not its connections: a peer frozen half-way through
    # the mesh (its process stopped, its sockets open) would hold this thread for good.
    built: list[dist.ProcessGroup | None] = []
    late = threading.Lock()

    def construct() -> None:
        pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        with late:
            built.append(pg)
            abandoned = built[0] is None
        if abandoned:  # built after the caller gave up: nobody else would close it
            close_group(pg)

    try:
        run_with_deadline(construct, timeout_s=timeout_s, what=what)
    except StageTimeout:
        with late:
            built.insert(0, None)
        raise
    group = built[0]
    assert group is not None
    return group


def _build_nccl(
    store: dist.Store, *, rank: int, world_size: int, timeout_s: float, gpu: torch.device, what: str
) -> dist.ProcessGroup:
    opts = dist.ProcessGroupNCCL.Options()
    # The group's own timeout only bounds what the watchdog reports; the deadlines are kept here, first.
    opts._timeout = _timeout(2 * timeout_s)
    with nccl_group_env():
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)

    def join() -> None:
        # NCCL connects lazily: one tiny collective makes a missing peer surface here, not mid-update. Rank 0's
        # ncclCommInitRank blocks this thread until every rank joins, so it is not the caller's thread.
        torch.cuda.set_device(gpu)  # the current device is per thread
        probe = torch.zeros(1, device=gpu)
        wait_work(pg.allreduce([probe]), timeout_s=timeout_s, what="weight-sync group probe")

    try:
        run_with_deadline(join, timeout_s=timeout_s, what=what)
    except BaseException:
        close_group(pg)
        raise
    return pg


def run_with_deadline(fn: Callable[[], None], *, timeout_s: float, what: str) -> None:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s`` for it (a blocking native call cannot be
    interrupted; on :class:`StageTimeout` it is left to return, or not, on its own thread)."""
    done = threading.Event()
    error: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="weight-sync-join", daemon=True).start()
    if not done.wait(max(0.001, timeout_s)):
        raise StageTimeout(f"{what}: no answer within {timeout_s:g}s (a peer died or never joined)")
    if error:
        raise error[0]


def wait_work(work: dist.Work, *, timeout_s: float, what: str = "broadcast") -> None:
    """Block this thread until ``work`` has completed, at most ``timeout_s``; :class:`StageTimeout` after.

    Polls ``is_completed()`` rather than calling ``wait()`` first: NCCL's ``wait()`` returns at once (it only
    makes the current stream wait), so it could never miss a deadline. Once complete, ``wait()`` raises the
    work's error, if any (and orders the current stream after an NCCL one).
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    pause = 5e-5
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise StageTimeout(f"{what}: not complete within {timeout_s:g}s (a peer died or stopped answering)")
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)
    work.wait()


def _gloo_device(host: str):  # type: ignore[no-untyped-def]
    """The interface this process' gloo endpoint listens on. Building the group from explicit options (so it
    can carry its own timeout) bypasses torch's reading of ``GLOO_SOCKET_IFNAME``, so it is read here: on a
    multi-homed host the hostname may resolve to an interface the peers cannot reach (docs/FLEETS.md)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname)
    if host in _LOOPBACK:  # on one machine the hostname may resolve to an interface loopback peers cannot reach
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor, *, src: int = 0) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def close_group(pg: dist.ProcessGroup | None) -> None:
    """Tear a group down so peers blocked on it fail fast instead of waiting for their timeout (for NCCL:
    abort the communicator, which also frees collectives stuck on a dead peer). Waits at most
    :data:`CLOSE_WAIT_S`: an abort that hangs (a communicator still joining) is left to its own thread."""
    if pg is None:
        return

    def close() -> None:
        for method in ("abort", "shutdown"):
            try:
                getattr(pg, method)()
                return
            except Exception:  # best effort: a broken group may refuse either
                continue

    closer = threading.Thread(target=close, name="weight-sync-close", daemon=True)
    closer.start()
    closer.join(CLOSE_WAIT_S)


class _StreamReceives:
    """The receives of one streamed update (:meth:`CollectiveReceive.stream`): segments posted in the sender's
    order, each bucket into a fresh buffer (``counted``), handed over whole once all its segments arrived."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        plan,
        segments: list[Segment],
        device: torch.device,
        *,
        counted: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.pg, self.plan, self.segments, self.device, self.counted = pg, plan, segments, device, counted
        self.buffers: dict[int, torch.Tensor] = {}
        self.works: dict[int, list[dist.Work]] = {}
        self.posted = 0
        """Segments posted so far."""

    def post_through(self, index: int) -> None:
        """Post every segment up to ``index``, in the sender's order: a collective must be posted in the same
        order on every rank."""
        src_rank = self.plan.collective.src_rank
        while self.posted <= index:
            s = self.segments[self.posted]
            if s.bucket not in self.buffers:
                self.buffers[s.bucket] = self.counted(empty_bucket(self.plan.buckets[s.bucket], self.device))
            chunk = self.buffers[s.bucket][s.start : s.end]
            self.works.setdefault(s.bucket, []).append(broadcast(self.pg, chunk, src=src_rank))
            self.posted += 1

    def take(self, bucket: int, *, timeout_s: float, what: str) -> torch.Tensor:
        """Wait for every segment of ``bucket`` (each at most ``timeout_s``); its buffer, forgotten here."""
        pending = self.works.pop(bucket)
        while pending:
            wait_work(pending.pop(), timeout_s=timeout_s, what=what)
        return self.buffers.pop(bucket)


class CollectiveReceive:
    """Receiver end: joins the group named in a plan and receives its buckets in a background thread.

    Kept across updates so an unchanged membership (same epoch) reuses the group, and the receive
    buffers too: they are allocated once per layout (bucket sizes and device) and received into again
    by later updates with that layout, because fresh ones page-fault on every first touch while the
    bytes arrive. There are up to two sets: a loader may *adopt* one (the model's parameters become
    views into it, no copy at commit; :func:`weight_sync.adopt.adopt_into_module`) and its delivery says
    so with :meth:`adopted`; the next update then receives into the other set, never into live weights. So a
    receiver holds two sets' worth of memory, of which the live one *is* the model's weights: about what
    a copying loader holds (the model plus one set). Updates are received one at a time (``lock``,
    which a loader also holds while it reads the buffers), so a late thread of an abandoned update never
    interleaves with the next, and a receive never overwrites buffers that are still being loaded.
    """

    def __init__(self, *, device: torch.device | str = "cpu", go_timeout_s: float = 150.0) -> None:
        self.device = torch.device(device)
        self.go_timeout_s = go_timeout_s
        self.lock = threading.Lock()
        self._pg: dist.ProcessGroup | None = None
        self._layout: tuple | None = None
        self._sets: list[list[torch.Tensor]] = []
        self._live: list[torch.Tensor] | None = None  # the set the model's parameters are views into
        self._epoch: tuple[str, int] | None = None
        self._store: dist.TCPStore | None = None
        self.stream_peak_bytes = 0
        """The most bytes of receive buffers alive at once during the last :meth:`stream` (measured: a
        buffer counts until its last reference, the loader's included, is gone)."""
        self.stream_bucket_bytes = 0
        """The largest bucket of the last :meth:`stream`."""
        self._stream_live = 0
        self._counting = threading.Lock()

    def receive(self, plan, *, timeout_s: float) -> list[torch.Tensor]:
        """Blocking: wait for ``go``, (re)build the group if the epoch changed, receive every bucket."""
        src = plan.collective
        device = self._thread_device(src.backend)
        with self.lock:
            self._join(plan, timeout_s=timeout_s, device=device)
            try:
                flats = self._buffers_for(plan, device)
            except Exception:
                self._drop_group()
                raise
            try:
                # Every segment's receive is posted up front (each into its byte range of a bucket), so the
                # sender never waits for a receiver to ask for the next one; they complete in order.
                segments = plan_segments(Layout.from_plan(plan), min_bytes=src.segment_min_bytes)
                works = [broadcast(self._pg, flats[s.bucket][s.start : s.end], src=src.src_rank) for s in segments]
                for work in works:  # each within the deadline of the one before: a dead sender is noticed
                    wait_work(work, timeout_s=timeout_s, what=f"update {plan.update_id}: receive")
                return flats
            except Exception:
                # A broken group is useless for the next update; the sender bumps the epoch anyway.
                # This set is dropped too (an aborted broadcast may still be writing into it); a live set
                # never is received into, so the model's weights are untouched.
                self._drop_group()
                self._sets = [s for s in self._sets if s is not flats]
                raise

    def stream(self, plan, *, timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        """Like :meth:`receive`, but bucket by bucket: yields each bucket's named tensors as soon as it has
        arrived, while the next bucket is received, so a loader can consume the update during the transfer.

        Each bucket is a fresh buffer this generator forgets once the consumer moves past it: the consumer's
        own references (a loader that buffers a layer's tensors until the layer is complete, as vLLM's
        layerwise reload does) keep it alive, never longer. So the receiving side holds at most two buckets
        (the one being consumed and the next) when the layout has one dtype, as the sender's publish dtype
        makes it (one bucket open at a time); one more per other dtype. The price is atomicity: a transfer
        that fails half-way has already loaded its first buckets (:class:`PartialUpdate`).
        """
        src = plan.collective
        device = self._thread_device(src.backend)
        with self.lock:
            self._join(plan, timeout_s=timeout_s, device=device)
            layout = Layout.from_plan(plan)
            members = layout.bucket_members()
            segments = plan_segments(layout, min_bytes=src.segment_min_bytes)
            last = {s.bucket: i for i, s in enumerate(segments)}  # each bucket's last segment
            order = sorted(last, key=last.__getitem__)  # buckets in the order they complete
            receives = _StreamReceives(self._pg, plan, segments, device, counted=self._counted)
            loaded = 0
            with self._counting:
                self.stream_peak_bytes = self._stream_live
            self.stream_bucket_bytes = max((int(b.num_bytes) for b in plan.buckets), default=0)
            try:
                receives.post_through(last[order[0]])
                for n, bucket in enumerate(order):
                    flat = receives.take(bucket, timeout_s=timeout_s, what=f"update {plan.update_id}: receive")
                    named = unpack(flat, members[bucket])[::-1]
                    del flat
                    while named:
                        yield named.pop()  # forgotten here as soon as it is handed over
                        loaded += 1
                        if n + 1 < len(order) and receives.posted <= last[order[n + 1]]:
                            # The next bucket is received while this one is loaded; posted only now that the
                            # loader has moved on from the bucket before (at most two buckets alive).
                            receives.post_through(last[order[n + 1]])
            except GeneratorExit:
                self._drop_group()
                raise
            except Exception as exc:
                self._drop_group()
                if loaded:
                    raise PartialUpdate(
                        f"update {plan.update_id}: {loaded} of {len(layout.tensors)} tensors handed over "
                        f"when the transfer failed ({exc!r})"
                    ) from exc
                raise

    def _counted(self, flat: torch.Tensor) -> torch.Tensor:
        nbytes = flat.numel()
        with self._counting:
            self._stream_live += nbytes
            self.stream_peak_bytes = max(self.stream_peak_bytes, self._stream_live)
        # The storage, not the tensor: a dtype view handed to the loader keeps the memory, not the tensor object.
        weakref.finalize(flat.untyped_storage(), self._uncount, nbytes)
        return flat

    def _uncount(self, nbytes: int) -> None:
        with self._counting:
            self._stream_live -= nbytes

    def _join(self, plan, *, timeout_s: float, device: torch.device) -> None:
        """Wait for the sender's ``go`` and (re)build the group when the epoch changed (holding ``lock``)."""
        src = plan.collective
        host, port = parse_init_method(src.init_method)
        if self._epoch != (src.init_method, src.group_epoch):
            self._drop_group()
            self._store = dist.TCPStore(host, port, is_master=False, timeout=_timeout(self.go_timeout_s))
        store = self._store
        key = go_key(plan.update_id, src.group_epoch)
        store.wait([key], _timeout(self.go_timeout_s))
        if store.get(key) != b"1":
            raise TransferAborted(f"update {plan.update_id}: the sender called it off (a member was not ready)")
        if self._pg is None:
            try:
                self._pg = build_group(
                    backend=src.backend,
                    store=store,
                    rank=src.rank,
                    world_size=src.world_size,
                    epoch=src.group_epoch,
                    timeout_s=timeout_s,
                    host=host,
                    device=device if device.type == "cuda" else None,
                )
            except Exception:
                self._drop_group()
                raise
            self._epoch = (src.init_method, src.group_epoch)

    def _drop_group(self) -> None:
        close_group(self._pg)
        self._pg, self._epoch = None, None

    def _thread_device(self, backend: str) -> torch.device:
        """The device to receive on, made this thread's current CUDA device: receives run on a thread of their
        own, whose current device is cuda:0 whatever the loader's is, and NCCL would put the group (and its
        probe) there — two ranks on one GPU is an NCCL error."""
        device = self._device_for(backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def _device_for(self, backend: str) -> torch.device:
        # NCCL moves CUDA memory only: its buffers live on the current GPU of whoever set ``device`` when that
        # names none or no index (:meth:`weight_sync.inbox.CollectiveReceiver.start` resolves it on the caller's
        # thread; here, on the receive thread, the current device is cuda:0 unless set).
        if backend == "nccl" and (self.device.type != "cuda" or self.device.index is None):
            return torch.device("cuda", torch.cuda.current_device())
        return self.device

    def _buffers_for(self, plan, device: torch.device) -> list[torch.Tensor]:
        """A set of receive buffers for this plan's layout that the model does not use as its weights."""
        key = (str(device), tuple(int(b.num_bytes) for b in plan.buckets))
        if self._layout != key:
            # A new layout: drop the old sets first (a live one stays alive through the model's parameters).
            self._sets, self._live, self._layout = [], None, key
        for flats in self._sets:
            if flats is not self._live:
                return flats
        flats = [empty_bucket(bucket, device) for bucket in plan.buckets]
        self._sets.append(flats)
        return flats

    def adopted(self, flats: list[torch.Tensor]) -> None:
        """The model's parameters are now views into ``flats`` (call holding ``lock``): never receive into them."""
        self._live = next((s for s in self._sets if s is flats), None)

    def close(self) -> None:
        with self.lock:
            close_group(self._pg)
            self._pg, self._epoch, self._store = None, None, None
            self._sets, self._live, self._layout = [], None, None
