"""Loading a received update without copying it: the parameters become views into the receive buffers.

A copying load (``targets.load_into_module``) moves every byte once more at commit, on the receiver's
cores, after the transfer — on a CPU box that copy cost as much as a third of the wire time. Here each
parameter's storage is swapped instead (``param.data = view``), which takes microseconds whatever the
size. All-or-nothing still holds: every name and shape is checked before the first parameter changes,
and the swap happens at commit, after the whole update arrived. The buffers must then never be
received into again while the model uses them, which ``CollectiveReceive`` guarantees with a second set
(:meth:`~weight_sync.collective.CollectiveReceive.adopted`).

A tensor whose dtype or device differs from its parameter's (bf16 weights from a float32 learner,
gloo's CPU buffers for a GPU model) is copied (cast) into the parameter as before; tied parameters (one
Parameter under two names) stay tied because the Parameter object is kept and only its data changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weight_sync.buckets import checksum

LoadResult = tuple[int, dict[str, float]]  # bytes loaded, checksum per tensor (empty unless asked)


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (tied ones under each name), what a weight update may name."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def matching(tensors: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The model's tensor ``name`` that update ``tensor`` replaces; a clear error on an unknown name or shape."""
    target = tensors.get(name)
    if target is None:
        raise KeyError(
            f"weight update names {name!r}, which this model does not have — learner and rollout "
            "servers must load the same architecture (model.path)"
        )
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: update has shape {tuple(tensor.shape)}, model has {tuple(target.shape)}")
    return target


@torch.no_grad()
def adopt_into_module(
    model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]], *, sums: bool
) -> tuple[LoadResult, int]:
    """Point each named parameter at its received tensor (or copy where dtype/device differ).

    Returns ``((bytes, checksums), adopted)``, ``adopted`` counting the parameters that now share the
    received buffers' memory. Raises before changing anything when a name or shape does not match.
    """
    tensors = module_tensors(model)
    pairs = [(name, matching(tensors, name, tensor), tensor) for name, tensor in named]
    nbytes, checksums, adopted = 0, {}, 0
    for name, target, tensor in pairs:
        if isinstance(target, torch.nn.Parameter) and target.dtype == tensor.dtype and target.device == tensor.device:
            target.data = tensor
            adopted += 1
        else:
            target.copy_(tensor)
        nbytes += tensor.numel() * tensor.element_size()
        if sums:
            checksums[name] = checksum(target)
    return (nbytes, checksums), adopted
