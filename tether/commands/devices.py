"""Which GPU each local process of ``tether up`` gets — including the one-GPU box, where they share it.

Without a plan every process would open ``cuda:0``: on a box with several GPUs the learner and vLLM would
crowd the first one, and on a box with one GPU vLLM's default share (85 % of its memory) would leave the
learner nothing. So ``tether up`` gives the learner's ranks GPUs ``0 … nproc−1`` and each rollout server
GPUs of its own after them, as many as its ``tensor_parallel_size`` (``CUDA_VISIBLE_DEVICES``); when there
are not enough GPUs for that but the run is one learner rank and GPU engines of one GPU each on a single
GPU, they share GPU 0, provided the engines leave the
learner room (``rollout.engine.gpu_memory_utilization`` at most :data:`SHARED_ENGINE_SHARE` in all) and
the weights travel by filesystem (NCCL cannot put two ranks on one GPU). Anything else is a config error
that says what to change. CPU runs (the transformers engine on CPU, ``learner.device: cpu``) are left alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

from tether.config import ConfigError, TetherConfig

SHARED_ENGINE_SHARE = 0.5
"""Of one shared GPU's memory, the most the rollout engines may take together (the learner needs the rest)."""


@dataclass
class DevicePlan:
    learner_env: dict[str, str] = field(default_factory=dict)
    rollout_envs: list[dict[str, str]] = field(default_factory=list)
    shared: bool = False


def count_gpus() -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L`` (0 without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _uses_gpu(cfg: TetherConfig, gpus: int) -> tuple[bool, bool]:
    """Whether the learner and the engines will open a GPU. ``auto`` does wherever one is visible (the learner
    and the transformers engine resolve it so themselves): left out of the plan, an ``auto`` engine would
    see every GPU and open ``cuda:0``, the learner's."""
    return cfg.learner.device != "cpu", cfg.rollout.engine.uses_gpu(gpus)


def plan_devices(cfg: TetherConfig, gpus: int) -> DevicePlan:
    """The ``CUDA_VISIBLE_DEVICES`` of the learner and of each rollout server on a box with ``gpus`` GPUs."""
    learner_gpu, engine_gpu = _uses_gpu(cfg, gpus)
    nproc, servers = cfg.learner.nproc_per_node, cfg.rollout.num_servers
    tp = getattr(cfg.rollout.engine, "tensor_parallel_size", 1) if engine_gpu else 0  # GPUs per server
    if gpus == 0 or not (learner_gpu or engine_gpu):
        return DevicePlan(rollout_envs=[{} for _ in range(servers)])
    needed = (nproc if learner_gpu else 0) + servers * tp
    if gpus >= needed:
        learner_ids = list(range(nproc)) if learner_gpu else []
        first = len(learner_ids)
        learner_env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, learner_ids))} if learner_gpu else {}
        rollout = [
            {"CUDA_VISIBLE_DEVICES": ",".join(str(first + i * tp + k) for k in range(tp))} if engine_gpu else {}
            for i in range(servers)
        ]
        return DevicePlan(learner_env, rollout)
    if tp > 1:
        raise ConfigError(
            f"{gpus} GPU(s) for {nproc if learner_gpu else 0} learner rank(s) and {servers} rollout server(s) of "
            f"tensor_parallel_size {tp} ({needed} GPUs): a tensor-parallel engine needs GPUs of its own — fewer "
            "servers, a smaller rollout.engine.tensor_parallel_size, or the fleet on its own node (docs/FLEETS.md)"
        )
    if nproc == 1 and gpus >= 1:
        return _shared_plan(cfg, servers)
    cpu_engine = (
        " or keep the engines off the GPUs with rollout.engine.device: cpu,"
        if engine_gpu and "device" in type(cfg.rollout.engine).model_fields
        else ""
    )
    raise ConfigError(
        f"{gpus} GPU(s) for {nproc} learner rank(s) and {servers} rollout server(s) on GPUs: give each its own "
        f"GPU,{cpu_engine} or share one GPU with learner.nproc_per_node: 1 (see README, 'One GPU')"
    )


def _shared_plan(cfg: TetherConfig, servers: int) -> DevicePlan:
    engine = cfg.rollout.engine
    share = getattr(engine, "gpu_memory_utilization", 0.0) * servers
    if share > SHARED_ENGINE_SHARE:
        raise ConfigError(
            f"rollout.engine.gpu_memory_utilization: {engine.gpu_memory_utilization} × {servers} server(s) of one "
            f"shared GPU leaves the learner too little; set it to at most {SHARED_ENGINE_SHARE / servers:.2f} "
            "(configs/one-gpu.yaml)"
        )
    if cfg.weight_sync.transport.type == "nccl":
        raise ConfigError(
            "weight_sync.transport.type: nccl cannot put the learner and a rollout server on one GPU — use "
            "filesystem on a one-GPU box (configs/one-gpu.yaml)"
        )
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    return DevicePlan(dict(env), [dict(env) for _ in range(servers)], shared=True)
