"""Loading named tensors into a ``torch.nn.Module`` without copying: parameters become views into the buffers.

A helper for engines that hold a live module (the transformers engine, the standalone receiver's model):
they call :func:`load_into_module` from their ``load_weights``; weight sync itself never does.

A copying load moves every byte once more at commit, on the receiver's cores, after the transfer — on a
CPU box that copy cost as much as a third of the wire time. Adoption swaps each parameter's storage
instead (``param.data = view``), which takes microseconds whatever the size. All-or-nothing still holds:
every name and shape is checked before the first parameter changes, and the swap happens at commit,
after the whole update arrived. The buffers must then never be received into again while the model
uses them: the loader answers ``LoadResult(kept=True)`` and ``CollectiveReceive`` switches to its second
set (:meth:`~weight_sync.collective.CollectiveReceive.adopted`).

A tensor whose dtype or device differs from its parameter's (bf16 weights from a float32 learner,
gloo's CPU buffers for a GPU model) is copied (cast) into the parameter as before; tied parameters (one
Parameter under two names) stay tied because the Parameter object is kept and only its data changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from weight_sync.loading import LoadResult, PartialUpdate


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
def adopt_into_module(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Point each named parameter at its received tensor (or copy where dtype/device differ).

    Returns how many parameters now share the received buffers' memory. Raises before changing anything
    when a name or shape does not match.
    """
    tensors = module_tensors(model)
    pairs = [(name, matching(tensors, name, tensor), tensor) for name, tensor in named]
    adopted = 0
    for _, target, tensor in pairs:
        if isinstance(target, torch.nn.Parameter) and target.dtype == tensor.dtype and target.device == tensor.device:
            target.data = tensor
            adopted += 1
        else:
            target.copy_(tensor)
    return adopted


@torch.no_grad()
def copy_into_module(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each ``(name, tensor)`` into the parameter or buffer of that name, in place, as it arrives
    (a snapshot streams shard by shard; nothing holds the whole update). A failure after the first copy
    (an unknown name or shape further on, an unreadable shard) is a :class:`PartialUpdate`: the model
    then mixes versions, and the receiver restores it from a snapshot."""
    tensors = module_tensors(model)
    copied = 0
    try:
        for name, tensor in named:
            matching(tensors, name, tensor).copy_(tensor)
            copied += 1
    except Exception as exc:
        if copied:
            raise PartialUpdate(f"{copied} tensors copied when the load failed ({exc!r})") from exc
        raise


def load_into_module(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], *, adoptable: bool
) -> LoadResult:
    """An engine's ``load_weights`` for a live module: adopt received buffers, copy anything transient."""
    if not adoptable:
        copy_into_module(model, named)
        return LoadResult()
    return LoadResult(kept=adopt_into_module(model, list(named)) > 0)
