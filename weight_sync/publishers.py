"""The one place that picks the learner's weight publisher from ``weight_sync.transport``: a push
(:class:`weight_sync.sender.WeightSender`) for gloo, NCCL and the filesystem, the weight store
(:class:`weight_sync.store_publisher.StorePublisher`) for ``store``. A transport's config says whether the
fleet pulls it (``transport.pulled``); nothing else compares transport names."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tether.config import TetherConfig
from weight_sync.publication import WeightPublisher


def make_publisher(
    cfg: TetherConfig,
    *,
    model: torch.nn.Module,
    params: Sequence[tuple[str, torch.Tensor]] | None = None,
    rank: int = 0,
    world_size: int = 1,
    registry: object | None = None,
    announce: Callable[[dict], None] | None = None,
    fleet: Callable[[], dict[str, int]] | None = None,
) -> WeightPublisher:
    """``registry`` (a ``buffer.ServerRegistry``) names a push's receivers; ``announce(info)`` and
    ``fleet() -> {server: version held}`` are a pull's (rank 0's Redis: weight sync never imports the buffer).
    ``params``: the named tensors an update carries (default: all of ``model``'s; LoRA: the adapters)."""
    if cfg.weight_sync.transport.pulled:
        from weight_sync.store_publisher import StorePublisher

        return StorePublisher(
            cfg, model=model, params=params, rank=rank, world_size=world_size, announce=announce, fleet=fleet
        )
    from weight_sync.sender import WeightSender

    return WeightSender(cfg, model=model, params=params, rank=rank, world_size=world_size, registry=registry)
