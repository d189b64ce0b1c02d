"""What one weight update costs: today's push from the learner, or a fleet that pulls deltas from peers.

A new version reaches N rollout servers (engines) one of two ways:

* **push** (``fanout`` 0): the learner sends it to every server in one collective broadcast at the rates
  file's ``weight_sync.gb_per_s``: ``latency_s + bytes / link`` whatever N. That is the planner's figure
  from before the weight service, kept as it was (a pipelined broadcast's time; every server still
  receives every byte, so N copies cross the fleet).
* **pull** (``fanout`` k >= 2): the version is published once and servers fetch it from peers in a k-ary
  tree. Servers 0..k-1 fetch from the origin (the learner's publication); server r >= k fetches from
  server (r - k) // k. Level d then holds k**d servers, and the depth is the least D with
  k + k**2 + ... + k**D >= N (ceil(log_k N) or one less). A sender's uplink carries its children's copies,
  so a hop takes (its children, at most k) × bytes / link — without that, fanout N would look free —
  and a server passes a version on once it holds it (store-and-forward; chunk pipelining would shorten
  the hops, so this is an upper bound). The origin sends k copies whatever N.

Time until every server holds the version: ``latency_s + encode + transfer + decode``; the codec runs at
CPU rates measured with ``bench/weight_delta.py`` (full bf16 bytes over seconds, one core), the encode on
the learner's host, the decode on each server. A version is a delta of ``delta_ratio`` × the full bf16
bytes, with a full base every ``base_every`` versions that travels the same path (servers that keep up
decode the delta; the base is for servers that join or fall behind): the byte figures amortise the base
over ``base_every`` versions, the time is a delta version's, and a base version's trip is given beside it.
``delta_ratio`` 1.0 sends full weights every version: no codec, no separate base. Nothing here imports
torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

MEASURED_DELTA_RATIO = 0.0123
"""Delta bytes ÷ full bf16 bytes at lr 1e-6: bench/weight_delta.py, 256-wide tiny model, 20 AdamW steps, 3
seeds (0.0122-0.0123). At lr 1e-5 it measured 0.0543; a Qwen2.5-0.5B shape gave 0.0145 and 0.0665."""
ENCODE_GB_PER_S = 1.0
"""Delta encode (bf16 bits → chunks with hashes), full bf16 GB/s per core; with DECODE_GB_PER_S, what
``bench/weight_delta.py --speed-only`` measured on one thread on this project's 2-core CPU machine (100M
bf16 elements after a real AdamW step at lr 1e-6: encode 1.0–1.4, decode 3.1–3.6 GB/s, medians of 3)."""
DECODE_GB_PER_S = 3.0
"""Delta decode (verify every hash, rebuild from the held version), full bf16 GB/s per core."""
PUSH = 0
"""``fanout`` 0: today's push from the learner."""


@dataclass(frozen=True)
class WeightPath:
    """How versions travel: the link, the delta's size, the distribution (push or a k-ary pull tree), the codec."""

    link_gb_per_s: float
    """One link's bandwidth (``weight_sync.gb_per_s``): the push's broadcast, a pull hop's uplink."""
    latency_s: float = 0.0
    """Fixed cost of one update (announce, pause, load, resume), either way."""
    delta_ratio: float = MEASURED_DELTA_RATIO
    fanout: int = PUSH
    base_every: int = 10
    encode_gb_per_s: float = ENCODE_GB_PER_S
    decode_gb_per_s: float = DECODE_GB_PER_S
    codec_cores: int = 1
    """Cores each side's codec uses (today's store encodes and decodes on one thread)."""

    def __post_init__(self) -> None:
        if not 0 < self.delta_ratio <= 1:
            raise ValueError(
                f"weight_sync.delta_ratio (--delta-ratio) must be > 0 and <= 1 (delta bytes over full bf16 bytes; "
                f"1.0 sends full weights every version), got {self.delta_ratio}"
            )
        if self.fanout == 1 or self.fanout < 0:
            raise ValueError(
                f"weight_sync.fanout (--fanout) must be 0 (push: today's broadcast from the learner) or >= 2 "
                f"(servers pull from peers in a tree of that fan-out), got {self.fanout}"
                + ("; 1 would chain every server behind the one before it, N hops deep" if self.fanout == 1 else "")
            )
        if self.base_every < 1:
            raise ValueError(f"weight_sync.transport.base_every (--base-every) must be >= 1, got {self.base_every}")
        if self.codec_cores < 1:
            raise ValueError(f"weight_sync.codec_cores (--codec-cores) must be >= 1, got {self.codec_cores}")
        for name, flag in (("link_gb_per_s", "gb_per_s"), ("encode_gb_per_s", None), ("decode_gb_per_s", None)):
            if not getattr(self, name) > 0:
                where = f"weight_sync.{flag or name}" + ("" if flag else f" (--{name.replace('_', '-')})")
                raise ValueError(f"{where} must be > 0, got {getattr(self, name)}")
        if self.latency_s < 0:
            raise ValueError(f"weight_sync.latency_s must be >= 0, got {self.latency_s}")

    @property
    def mode(self) -> Literal["push", "pull"]:
        return "push" if self.fanout == PUSH else "pull"

    @property
    def is_delta(self) -> bool:
        return self.delta_ratio < 1

    def label(self) -> str:
        how = "push" if self.mode == "push" else f"pull, fanout {self.fanout}"
        return f"{how}, " + (f"delta {self.delta_ratio:g}" if self.is_delta else "full")


def full_push(path: WeightPath) -> WeightPath:
    """Today's weight path on the same link: full bf16 weights every version, pushed from the learner."""
    return replace(path, delta_ratio=1.0, fanout=PUSH)


def pull_of(path: WeightPath) -> WeightPath:
    """The store transport's pull on the same link: ``path`` itself when it pulls, else fan-out 2 with the
    measured delta ratio (unless the push was given a ratio of its own)."""
    if path.fanout != PUSH:
        return path
    return replace(path, fanout=2, delta_ratio=MEASURED_DELTA_RATIO if path.delta_ratio == 1.0 else path.delta_ratio)


def tree_parent(rank: int, fanout: int) -> int | None:
    """The server ``rank`` fetches from in a pull tree; None: the origin."""
    return None if rank < fanout else (rank - fanout) // fanout


def tree_levels(servers: int, fanout: int) -> list[int]:
    """Servers at each depth of the pull tree (level d holds fanout**d, the last what is left)."""
    levels, left = [], servers
    while left > 0:
        levels.append(min(fanout ** (len(levels) + 1), left))
        left -= levels[-1]
    return levels


def tree_depth(servers: int, fanout: int) -> int:
    """Hops from the origin to the deepest server: the least D with fanout + ... + fanout**D >= servers."""
    return len(tree_levels(servers, fanout))


@dataclass(frozen=True)
class SyncCost:
    """One update on one weight path; bytes per version with the base amortised."""

    path: WeightPath
    servers: int
    hops: int
    """Transfers in sequence before the last server holds the version (push: one broadcast)."""
    seconds: float
    """Until every server holds a delta version (what the simulation charges per update)."""
    latency_s: float
    encode_s: float
    transfer_s: float
    decode_s: float
    base_seconds: float
    """A base version's trip along the same path (full bytes); equals ``seconds`` without deltas."""
    version_bytes: float
    """What one server receives for a delta version."""
    wire_bytes: float
    """What all servers receive per version."""
    origin_bytes: float
    """What leaves the origin per version (push: a copy per server, as a point-to-point push sends it)."""

    @property
    def mode(self) -> Literal["push", "pull"]:
        return self.path.mode

    @property
    def codec_s(self) -> float:
        return self.encode_s + self.decode_s

    def break_even(self, today: SyncCost) -> float | None:
        """How many times slower the link (or how many times more codec cores) would make this path as fast as
        ``today``'s: both transfers scale with the link, the codec with its cores. None: it is already no
        slower, or it has no codec or no wire time to gain."""
        gain = today.transfer_s - self.transfer_s
        if self.seconds <= today.seconds or self.codec_s == 0 or gain <= 0:
            return None
        return self.codec_s / gain


def _transfer_s(path: WeightPath, nbytes: float, servers: int) -> tuple[int, float]:
    link = path.link_gb_per_s * 1e9
    if path.mode == "push":
        return 1, nbytes / link
    levels = tree_levels(servers, path.fanout)
    # The busiest sender of each level serves min(fanout, servers at the level) children over its uplink.
    return len(levels), sum(min(path.fanout, n) * nbytes / link for n in levels)


def sync_cost(path: WeightPath, *, full_bytes: float, servers: int) -> SyncCost:
    """The cost of one update of ``full_bytes`` (bf16 weights) to ``servers`` servers on ``path``."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    version = path.delta_ratio * full_bytes
    # A server that keeps up fetches the delta only (the store writes a delta beside each base too); a base
    # travels to a server that joins or fell behind, priced by ``base_seconds``.
    per_server = version
    encode = full_bytes / (path.encode_gb_per_s * 1e9 * path.codec_cores) if path.is_delta else 0.0
    decode = full_bytes / (path.decode_gb_per_s * 1e9 * path.codec_cores) if path.is_delta else 0.0
    hops, transfer = _transfer_s(path, version, servers)
    _, base_transfer = _transfer_s(path, full_bytes, servers)
    senders = servers if path.mode == "push" else min(path.fanout, servers)
    return SyncCost(
        path=path,
        servers=servers,
        hops=hops,
        seconds=path.latency_s + encode + transfer + decode,
        latency_s=path.latency_s,
        encode_s=encode,
        transfer_s=transfer,
        decode_s=decode,
        base_seconds=path.latency_s + encode + base_transfer + decode,
        version_bytes=version,
        wire_bytes=servers * per_server,
        origin_bytes=senders * per_server,
    )
