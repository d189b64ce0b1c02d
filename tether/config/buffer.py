"""``buffer``: the Redis streams between rollout servers and the learner."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tether.config.base import Section


class BufferConfig(Section):
    redis_url: str = ""
    """``redis://[user:password@]host:port/db`` or ``rediss://`` for TLS. Empty: start an embedded
    Redis on a free loopback port with its data in the run folder (local runs only)."""

    max_trajectory_groups: int = Field(default=1024, gt=0)
    """Bound on unacknowledged groups in the trajectories stream; producers wait beyond it."""

    max_trajectory_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)
    """Bound on bytes of unacknowledged groups; producers wait beyond it."""

    put_timeout_s: float = Field(default=60.0, gt=0)
    """How long a producer waits for room before the put fails with a backpressure error."""

    claim_idle_ms: int = Field(default=60_000, gt=0)
    """Entries pending this long on a consumer are reclaimed by another (XAUTOCLAIM)."""

    max_deliveries: int = Field(default=5, gt=0)
    """An entry delivered more often than this goes to the dead-letter stream."""

    compression: Literal["none", "zlib"] = "none"
    """Compression of large trajectory payloads. Off by default: zlib level 1 runs at roughly 50-100 MB/s
    per core and random log-probs and token ids barely shrink, while Redis on a local or datacenter link
    stores and serves over 1 GB/s, so compressing only slows the buffer down (bench/buffer.py
    --compression zlib shows it). Worth turning on only when Redis sits across a slow link."""

    compress_min_bytes: int = Field(default=256 * 1024, ge=0)
    """Payloads smaller than this are stored uncompressed."""

    compress_level: int = Field(default=1, ge=1, le=9)
    """zlib level when compressing (1: fastest; higher levels cost much CPU for little gain on log-probs)."""

    dedup_ttl_s: float = Field(default=3600.0, gt=0)
    """How long a group id is remembered, so a retried insert within this window is not duplicated."""

    dead_letter_maxlen: int = Field(default=1000, gt=0)
    """Approximate cap on dead-letter entries kept (oldest trimmed first; the counter keeps the total)."""

    appendonly: bool = False
    """Embedded Redis only: turn on the append-only file (fsync every second)."""
