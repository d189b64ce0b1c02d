"""``weight_sync``: how new weights travel from the learner to the rollout fleet."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from tether.config.base import Section


class NcclTransport(Section):
    """GPU to GPU broadcast over NCCL."""

    type: Literal["nccl"] = "nccl"
    collective: ClassVar[bool] = True
    """Receivers join one process group with the learner (a server is one rank in it); else each reads alone."""
    pulled: ClassVar[bool] = False
    master_addr: str = "127.0.0.1"
    """Address of learner rank 0 that receivers connect to for the weight-sync group."""
    master_port: int = Field(default=29600, ge=0, le=65535)
    """Port of the weight-sync rendezvous (not torchrun's); 0 picks a free one."""


class GlooTransport(Section):
    """CPU broadcast over gloo: the CPU path and the one tests use."""

    type: Literal["gloo"] = "gloo"
    collective: ClassVar[bool] = True
    pulled: ClassVar[bool] = False
    master_addr: str = "127.0.0.1"
    """Address of learner rank 0 that receivers connect to for the weight-sync group."""
    master_port: int = Field(default=29600, ge=0, le=65535)
    """Port of the weight-sync rendezvous (not torchrun's); 0 picks a free one."""


class FilesystemTransport(Section):
    """Safetensors snapshot plus a version marker on a shared filesystem."""

    type: Literal["filesystem"] = "filesystem"
    collective: ClassVar[bool] = False
    pulled: ClassVar[bool] = False
    path: str = ""
    """Snapshot folder; empty: ``{run}/snapshots``."""


class StoreTransport(Section):
    """Versions published once into a store (manifest + chunks, a delta against the version before, a full
    base every ``base_every``), pulled by every server: from a peer that holds it (a tree of
    fan-out ``fanout``), from ``mirrors`` or ``relays``, or from the learner's own chunk service (the origin)."""

    type: Literal["store"] = "store"
    collective: ClassVar[bool] = False
    pulled: ClassVar[bool] = True
    """The fleet fetches each version itself (the learner waits for it to be held); a push otherwise."""
    path: str = ""
    """The store directory the learner writes; empty: ``{run}/weights``."""
    host: str = "127.0.0.1"
    """Address the learner's chunk service binds and announces (servers on other nodes fetch from it)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the learner's chunk service; 0 picks a free one (announced in Redis)."""
    peer_host: str = ""
    """Address each server's own chunk service binds and announces to its peers; empty: the host part of
    the server's gRPC address."""
    fanout: int = Field(default=2, ge=0)
    """Servers fetching straight from the origin (or relays); each of the others fetches from a peer
    first (node r from node (r − fanout) // fanout), so the learner sends each version ``fanout`` times
    however large the fleet. 0: every server fetches from the origin / relays (no peers)."""
    mirrors: list[str] = Field(default_factory=list)
    """Copies of the store's directory layout to pull from, as URLs (``file:///mnt/weights``; each scheme is a
    class in ``weight_sync.mirrors.MIRRORS``, docs/EXTENDING.md), asked in order after the peers and before
    the relays. Not ``relays``: a mirror is any place that serves the files the learner writes, a relay a
    ``tether relay`` process. A scheme with no class stops the rollout server when its puller starts."""
    relays: list[str] = Field(default_factory=list)
    """``tether relay`` addresses (host:port), asked after the peer and the mirrors and before the origin."""
    base_every: int = Field(default=10, gt=0)
    """A full base every N versions (a delta against the version before otherwise, and beside each base); a
    server that is new or far behind fetches the newest base and the deltas after it."""
    chunk_mb: float = Field(default=4.0, gt=0)
    """Size of one chunk of a version (the unit that is hashed, fetched and refetched)."""
    keep_versions: int = Field(default=4, gt=0)
    """Versions kept readable in the store (each with the base and deltas it needs)."""
    shared: bool = False
    """Every server mounts ``path`` too (a shared filesystem): read it directly before any network source."""
    chunk_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline for one chunk from one source before the next source is asked."""
    poll_s: float = Field(default=0.02, gt=0)
    """How often a server reads the announced version from Redis."""

    @field_validator("mirrors")
    @classmethod
    def _mirror_urls(cls, mirrors: list[str]) -> list[str]:
        # Only the form here: the schemes are weight_sync's (the config imports no library), checked at start.
        for url in mirrors:
            scheme, sep, rest = url.partition("://")
            if not (scheme and sep and rest):
                raise ValueError(f"{url!r} is not a URL (<scheme>://…, e.g. file:///mnt/weights); "
                                 "a tether relay's host:port goes in relays")  # fmt: skip
        return mirrors


TransportConfig = Annotated[
    NcclTransport | GlooTransport | FilesystemTransport | StoreTransport, Field(discriminator="type")
]


class WeightSyncConfig(Section):
    transport: TransportConfig = Field(default_factory=FilesystemTransport)
    """``type: nccl | gloo | filesystem | store``."""

    sync_every: int = Field(default=1, gt=0)
    """Learner steps between weight publications (each publication is version + 1)."""

    async_publish: bool = True
    """With ``algorithm.max_staleness`` ≥ 1, the learner packs the new weights and starts the next step
    while they are sent (at most one publication in flight; admission counts from the version the servers
    hold, so the staleness bound still holds). ``max_staleness: 0`` always publishes before the next step."""

    bucket_size_mb: float = Field(default=256.0, gt=0)
    """Size of one flat transfer buffer per dtype."""

    direct_tensor_mb: float = Field(default=8.0, ge=0)
    """Collective transports: a tensor of at least this many MiB is broadcast on its own, straight from the
    gathered tensor into its place in the receivers' bucket (no pack copy on the learner); smaller tensors
    are packed and sent in runs. 0: pack everything (one broadcast per bucket). 8 rather than 1: each
    broadcast has a fixed cost, and on loopback gloo a 1–6 MiB tensor sent alone cost more than packing it
    (``bench/weight_sync.py``, 2 cores, 4 runs at 8 and 3 at 1: 1 receiver 0.81–0.91 of one raw broadcast at
    8 against 0.72–0.78 at 1; 2 receivers 0.90–0.96 against 0.96–1.04)."""

    inflight: Literal["keep", "drain"] = "keep"
    """During an update, in-flight requests continue on the new weights (``keep``; tokens carry the
    version that produced them) or finish on the old ones first (``drain``)."""

    prepare_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline for a receiver to pause and get ready."""

    transfer_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline for the bucket transfer."""

    commit_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline for a receiver to load the weights and resume."""

    snapshot_every: int = Field(default=1, ge=0)
    """Also write a filesystem snapshot every N publications so late servers catch up; 0: never
    (beyond the filesystem transport itself)."""

    keep_snapshots: int = Field(default=2, gt=0)
    """Snapshots kept on disk."""

    verify_checksums: bool = False
    """Receivers return a float64 sum per tensor of what they loaded in CommitWeightUpdateResponse, and the
    learner compares them with its own (costs one extra pass over the weights on both sides)."""

    publish_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype floating weights travel in: the store transport publishes versions (and takes deltas) in
    it, and the collective pushes (``gloo``, ``nccl``) cast each tensor to it as gathered and send it so
    (checksums are of what is sent; a snapshot written beside a push holds the same bytes), so a bf16
    engine receives half a float32 learner's bytes and loads them without a cast. ``auto``: the dtype the
    rollout engines serve (``model.dtype``: bfloat16 on GPU, float32 on CPU). The ``filesystem`` transport
    ignores it (its snapshots keep the learner's exact weights). bfloat16 is what makes store deltas
    small: at lr 1e-6 a bf16 delta is about 1 % of the full bytes, a float32 one 40–50 %."""
