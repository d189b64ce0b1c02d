"""Activation offload (``learner.enable_activation_offload``, verl's name): the tensors autograd saves
for backward go to pinned CPU memory in forward and come back in backward.

With gradient checkpointing only each block's input is saved, so the GPU holds one block's activations
at a time and the rest of the step's checkpoints wait on the host. Parameters are never offloaded: FSDP2
gathers and frees them itself, and a copy of every gathered weight would cost a weight transfer per
layer. On CPU there is nothing to offload to; the switch is ignored with one warning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from tether.config import TetherConfig
from tether.logs import get_logger

log = get_logger(__name__)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved CUDA tensors (not parameters) to pinned host memory; ``offloaded_bytes`` counts them."""

    offloaded_bytes = 0

    def __init__(self) -> None:
        super().__init__(self._pack, self._unpack)

    @classmethod
    def _pack(cls, t: Tensor) -> tuple[torch.device | None, Tensor]:
        if t.device.type != "cuda" or isinstance(t, torch.nn.Parameter):
            return None, t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        host.copy_(t)
        cls.offloaded_bytes += t.numel() * t.element_size()
        return t.device, host

    @staticmethod
    def _unpack(packed: tuple[torch.device | None, Tensor]) -> Tensor:
        device, t = packed
        return t if device is None else t.to(device, non_blocking=True)


def activation_offload(cfg: TetherConfig, device: torch.device) -> Callable[[], AbstractContextManager]:
    """The context the trainer runs each training forward in: offloading, or nothing."""
    if not cfg.learner.enable_activation_offload:
        return contextlib.nullcontext
    if device.type != "cuda":
        log.warning("activation_offload_ignored", reason="learner.enable_activation_offload needs CUDA; "
                    "on CPU the activations already live in host memory")  # fmt: skip
        return contextlib.nullcontext
    if not cfg.learner.enable_gradient_checkpointing:
        log.info("activation_offload_without_checkpointing", hint="every saved activation crosses to the host; "
                 "with enable_gradient_checkpointing only what the blocks keep does")  # fmt: skip
    return ActivationOffload
