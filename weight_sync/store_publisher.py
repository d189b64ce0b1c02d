"""The learner's side of the ``store`` transport: each version published once; the fleet pulls it.

    publish(v) on every rank:  gather full tensors (a collective when sharded) ─► rank 0 casts them into
    the publish dtype (``VersionWriter.stage``: the only part that reads the model)
    then, on a thread of rank 0 when in the background:
      encode (a delta against v−1; a base every ``base_every``) ─► write chunks, then the manifest
      ─► announce v (Redis: version + the origin's address) ─► wait until every live server holds v

Rank 0 also runs the *origin*: a chunk service over the store directory (``chunk_service.serve``), which
servers on other nodes fetch from — at most ``fanout`` of them; the others fetch from their peers
(``weight_sync.puller``). Nothing here talks to a server: servers learn of v from the announcement and
report the version they hold, which is all the learner waits on (at most ``transfer_timeout_s +
commit_timeout_s``; a server that is late is reported dropped, as in a push, and keeps pulling).

A :class:`weight_sync.publication.WeightPublisher`, so the learner drives it as it drives a push. Redis is
the learner's: it passes ``announce(info)`` and ``fleet() -> {server: version held}`` in (weight sync never
imports the buffer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger
from weight_sync.publication import Deliver, WeightPublisher, params_device, publish_dtype
from weight_sync.sender import full_tensor
from weight_sync.sources import DirSource
from weight_sync.store import VersionStore, VersionWriter
from weight_sync.versions import Weights

log = get_logger(__name__)

Announce = Callable[[dict], None]
HeldVersions = Callable[[], dict[str, int]]
"""The version each live server holds, by server id (what a publication waits for)."""


def store_root(cfg: TetherConfig) -> Path:
    """``weight_sync.transport.path`` when set, else ``{run}/weights``."""
    transport = cfg.weight_sync.transport
    if transport.type == "store" and transport.path:
        return Path(transport.path)
    from tether.runs import run_paths

    return run_paths(cfg).root / "weights"


class StorePublisher(WeightPublisher):
    base_at_start = True

    def __init__(
        self,
        cfg: TetherConfig,
        *,
        model: torch.nn.Module,
        params: Sequence[tuple[str, torch.Tensor]] | None = None,
        rank: int = 0,
        world_size: int = 1,
        announce: Announce | None = None,
        fleet: HeldVersions | None = None,
    ) -> None:
        super().__init__(cfg, model=model, params=params, rank=rank, world_size=world_size)
        self.announce, self.fleet = announce, fleet
        self.origin = None
        if rank == 0:
            self.root = store_root(cfg)
            # No fsync: every chunk is named by its hash and checked by every reader, a manifest is renamed into
            # place whole, and a learner that restarts republishes its version as a base — fsync made the write
            # the noisiest stage of an update (0.04–1.08 s for 3 MB, bench/weight_service.py).
            self.store = VersionStore(self.root, fsync=False)
            self.writer = VersionWriter(
                self.store,
                dtype=publish_dtype(cfg, params_device(self._params)),
                base_every=self.wcfg.transport.base_every,
                chunk_bytes=max(1, int(self.wcfg.transport.chunk_mb * 2**20)),
                keep=self.wcfg.transport.keep_versions,
            )
            from tether.auth import auth_token
            from weight_sync.chunk_service import serve

            transport = self.wcfg.transport
            token = auth_token(cfg.rollout.auth_token) or None
            self.origin = serve(DirSource(self.root), host=transport.host, port=transport.port, token=token)
            log.info("weight_origin_serving", address=self.origin.address, store=str(self.root))

    def _stage(self, version: int, *, snapshot: bool, background: bool, start: float) -> Deliver | None:
        """Every rank gathers parameter by parameter; rank 0 casts each into the version's buffer. With
        ``snapshot`` (a resumed learner's first publication) versions after ``version`` leave the store (their
        timeline is gone) and ``version`` is written as a base."""
        with spans.span("weight_stage", version=version):
            staged = self._gather_cast(version)
        if staged is None:
            return None
        if snapshot:
            self.store.truncate(after=version - 1)
        return lambda on_done: self._deliver(staged, start, on_done, base=snapshot, background=background)

    @torch.no_grad()
    def _gather_cast(self, version: int) -> Weights | None:
        """Every rank gathers parameter by parameter; rank 0 casts each into the publication buffer."""

        def gathered():
            for name, param in self._params:
                full = full_tensor(param).detach()  # a collective on all ranks when the parameter is sharded
                yield name, full

        if self.rank != 0:
            for _ in gathered():
                pass
            return None
        weights = self.writer.stage(version, gathered())
        if any(p.device.type == "cuda" for _, p in self._params[:1]):
            torch.cuda.current_stream().synchronize()
        return weights

    def _deliver(
        self,
        weights: Weights,
        start: float,
        on_done: Callable[[dict[str, float]], None] | None,
        *,
        base: bool,
        background: bool,
    ) -> dict[str, float]:
        version = weights.version
        stage_s = time.perf_counter() - start
        with spans.span("weight_write", version=version):  # encode (delta, dtype) and write to the store
            published = self.writer.commit(weights, base=base)
        if self.announce is not None:
            self.announce({"version": version, "origin": self.origin.address if self.origin else "",
                           "dtype": weights.dtype, "time": time.time()})  # fmt: skip
        publish_s = time.perf_counter() - start
        with spans.span("weight_await_fleet", version=version):
            reached, dropped, servers = self._await_fleet(version)
        seconds = time.perf_counter() - start
        self.last_dropped = dropped
        delta = published.delta_bytes
        metrics = {
            "weight_sync/version": float(version),
            "weight_sync/bytes": float(delta if delta is not None else published.manifests["base"].stored_bytes),
            "weight_sync/full_bytes": float(published.full_bytes),
            "weight_sync/delta_ratio": (delta / published.full_bytes) if delta is not None else 1.0,
            "weight_sync/seconds": seconds,
            "weight_sync/stage_seconds": stage_s,
            "weight_sync/encode_seconds": published.encode_seconds,
            "weight_sync/write_seconds": published.write_seconds,
            "weight_sync/publish_seconds": publish_s,
            "weight_sync/pull_seconds": seconds - publish_s,
            "weight_sync/reached": float(reached),
            "weight_sync/dropped": float(len(dropped)),
            "weight_sync/base": float("base" in published.kinds),
            "weight_sync/background": float(background),
        }
        if self.origin is not None:
            metrics["weight_sync/origin_bytes_out"] = float(self.origin.bytes_out())
        log.info("weights_published", version=version, servers=servers, reached=reached, dropped=sorted(dropped),
                 kinds=published.kinds, bytes=int(metrics["weight_sync/bytes"]), seconds=round(seconds, 3))  # fmt: skip
        if on_done is not None:
            on_done(metrics)
        return metrics

    def _await_fleet(self, version: int) -> tuple[int, dict[str, str], int]:
        """Wait until every live server holds ``version`` (or its deadline); (reached, dropped, servers)."""
        if self.fleet is None:
            return 0, {}, 0
        deadline = time.monotonic() + self.wcfg.transfer_timeout_s + self.wcfg.commit_timeout_s
        held = self.fleet()
        while held and min(held.values()) < version and time.monotonic() < deadline:
            time.sleep(0.005)
            held = self.fleet()
        dropped = {s: f"holds v{v} at the deadline" for s, v in held.items() if v < version}
        return len(held) - len(dropped), dropped, len(held)

    def _close(self) -> None:
        if self.origin is not None:
            self.origin.stop(0)
