"""Which GPU each process of ``tether up`` gets, on boxes with 0, 1 and several GPUs (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.commands.devices import count_gpus, plan_devices
from tether.config import ConfigError, TetherConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**over: object) -> TetherConfig:
    base = {
        "rollout": {"engine": {"type": "vllm", "gpu_memory_utilization": 0.4}, "num_servers": 1},
        "learner": {"device": "cuda", "nproc_per_node": 1},
        "weight_sync": {"transport": {"type": "filesystem"}},
    }
    for section, values in over.items():
        base[section] = {**base.get(section, {}), **values}
    return TetherConfig.model_validate(base)


def test_enough_gpus_give_each_process_its_own() -> None:
    plan = plan_devices(_cfg(learner={"nproc_per_node": 2}, rollout={"num_servers": 2}), gpus=4)
    assert plan.learner_env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert plan.rollout_envs == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    assert not plan.shared


def test_a_tensor_parallel_server_gets_as_many_gpus_as_its_size() -> None:
    engine = {"type": "vllm", "gpu_memory_utilization": 0.4, "tensor_parallel_size": 2}
    plan = plan_devices(_cfg(learner={"nproc_per_node": 2}, rollout={"num_servers": 2, "engine": engine}), gpus=6)
    assert plan.learner_env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert plan.rollout_envs == [{"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5"}]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 \(6 GPUs\)"):
        plan_devices(_cfg(learner={"nproc_per_node": 2}, rollout={"num_servers": 2, "engine": engine}), gpus=5)
    with pytest.raises(ConfigError, match="GPUs of its own"):  # never squeezed onto the shared GPU
        plan_devices(_cfg(rollout={"engine": engine}), gpus=2)
    sglang = {"type": "sglang", "gpu_memory_utilization": 0.4, "tensor_parallel_size": 4}
    plan = plan_devices(_cfg(rollout={"engine": sglang}), gpus=5)
    assert plan.rollout_envs == [{"CUDA_VISIBLE_DEVICES": "1,2,3,4"}]


def test_one_gpu_is_shared_when_the_engine_leaves_the_learner_room() -> None:
    plan = plan_devices(_cfg(), gpus=1)
    assert plan.shared
    assert plan.learner_env == plan.rollout_envs[0] == {"CUDA_VISIBLE_DEVICES": "0"}


def test_one_gpu_refuses_what_cannot_share_it() -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):  # vLLM's default share starves the learner
        plan_devices(_cfg(rollout={"engine": {"type": "vllm", "gpu_memory_utilization": 0.85}}), gpus=1)
    with pytest.raises(ConfigError, match="nccl"):
        plan_devices(_cfg(weight_sync={"transport": {"type": "nccl"}}), gpus=1)
    with pytest.raises(ConfigError, match="nproc_per_node"):
        plan_devices(_cfg(learner={"nproc_per_node": 2}), gpus=1)


def test_cpu_runs_are_left_alone() -> None:
    cpu = _cfg(rollout={"engine": {"type": "transformers", "device": "cpu"}}, learner={"device": "cpu"})
    assert plan_devices(cpu, gpus=2).learner_env == {} and plan_devices(cpu, gpus=0).rollout_envs == [{}]
    assert plan_devices(_cfg(), gpus=0).learner_env == {}  # no GPU visible: nothing to assign


def test_an_auto_transformers_engine_gets_a_gpu_of_its_own_or_shares_one() -> None:
    auto = {"engine": {"type": "transformers", "device": "auto"}}
    plan = plan_devices(_cfg(rollout=auto, learner={"device": "auto"}), gpus=2)
    # Left out of the plan it would see both GPUs and open cuda:0, the learner's.
    assert plan.learner_env == {"CUDA_VISIBLE_DEVICES": "0"} and plan.rollout_envs == [{"CUDA_VISIBLE_DEVICES": "1"}]
    assert plan_devices(_cfg(rollout=auto, learner={"device": "auto"}), gpus=1).shared
    with pytest.raises(ConfigError, match="nccl"):
        plan_devices(_cfg(rollout=auto, weight_sync={"transport": {"type": "nccl"}}), gpus=1)
    assert plan_devices(_cfg(rollout=auto, learner={"device": "cpu"}), gpus=0).rollout_envs == [{}]
    with pytest.raises(ConfigError, match=r"rollout\.engine\.device: cpu"):  # two ranks and the engine on 2 GPUs
        plan_devices(_cfg(rollout=auto, learner={"nproc_per_node": 2}), gpus=2)


def test_count_gpus_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert count_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert count_gpus() == 0


def test_the_one_gpu_config_fits_one_gpu() -> None:
    cfg = load_config(ROOT / "configs" / "one-gpu.yaml", ["--model.path", "/models/m"])
    plan = plan_devices(cfg, gpus=1)
    assert plan.shared and cfg.weight_sync.transport.type == "filesystem"


def test_compose_one_gpu_config_shares_and_the_default_would_not() -> None:
    one = load_config(ROOT / "deploy" / "configs" / "gpu-one.yaml", [])
    assert plan_devices(one, gpus=1).shared
    with pytest.raises(ConfigError):  # the multi-GPU stack's config on one GPU: vLLM's 0.85 and NCCL
        plan_devices(load_config(ROOT / "deploy" / "configs" / "gpu.yaml", []), gpus=1)
    compose = (ROOT / "deploy" / "docker-compose.yml").read_text()
    assert compose.count("/etc/tether/$$TETHER_CONFIG") == 2  # learner and rollout both read the chosen config
