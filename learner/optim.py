"""The learner's optimizer: torch's AdamW, stepped on the local shards of FSDP2's DTensors.

AdamW is elementwise, so on sharded parameters DTensor runs each of its kernels on the local shards
anyway; what it adds is dispatch — sharding propagation for every operator of every step. At the demo size
that dispatch was most of the optimizer step (issue 23). :class:`LocalAdamW` hands the very same kernels the
local tensors instead: the parameters, their gradients and the moments are DTensors with one placement, and
their ``_local_tensor`` is the storage DTensor would have updated, so the numbers are the same bit for bit.

The optimizer's state stays what torch's AdamW keeps (DTensor moments, a step count per parameter), so
checkpoints (``torch.distributed.checkpoint``) are those of the plain optimizer, and a run resumes from
either. Where a tensor is not a DTensor, or its gradient or moments are placed unlike it, the step is
DTensor's own.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tether.config import TetherConfig


class LocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs on the local tensors of same-placed DTensors (see the module).

    ``local_step``: set False to step through DTensor dispatch (the reference, and a bench's switch).
    """

    local_step = True

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):  # type: ignore[no-untyped-def,override]
        has_complex = super()._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
        if self.local_step and _same_placement([t for part in lists for t in part]):
            for part in lists:
                part[:] = [t._local_tensor for t in part]  # the storage DTensor updates in place
        return has_complex


def _same_placement(tensors: list[torch.Tensor]) -> bool:
    """All DTensors on one mesh with one placement (pointwise kernels on their shards are then exact)."""
    if not tensors or not all(isinstance(t, DTensor) for t in tensors):
        return False
    mesh, placements = tensors[0].device_mesh, tensors[0].placements
    return all(t.device_mesh == mesh and t.placements == placements for t in tensors)


def build_optimizer(cfg: TetherConfig, params: list[torch.nn.Parameter]) -> LocalAdamW:
    """AdamW over ``params`` with the learner's knobs; fused where the device has the kernel."""
    lc = cfg.learner
    return LocalAdamW(
        params,
        lr=lc.lr,
        betas=lc.betas,
        eps=lc.eps,
        weight_decay=lc.weight_decay,
        # One fused kernel per step instead of the per-tensor loop torch picks for CPU DTensors (~10x the
        # optimizer step at the demo size, busy 2-core box); torchtitan's default implementation.
        fused=all(p.device.type in ("cpu", "cuda") for p in params) or None,
    )
