"""The learner side for real: a 2-rank gloo FSDP2-sharded tiny model → gather → receivers get full weights,
synchronously (version 1) and off the critical path while the ranks train on (version 2).

The two learner ranks are spawned as ``python THIS_FILE`` with torchrun's environment variables (no
pickled arguments); receivers are standalone receiver subprocesses; results come back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tether.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _perturb(model: torch.nn.Module) -> None:
    """The 'training step' both the learner ranks and the test apply: deterministic and visible."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * (i + 1))


def worker() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tests.weight_receiver import ModelEngine
    from tether.config.loader import load_config
    from weight_sync.sender import WeightSender

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(os.environ["WS_CONFIG"])
    model = ModelEngine.from_path(os.environ["WS_MODEL"]).model
    _perturb(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    sender = WeightSender(cfg, model=model, rank=rank, world_size=world, servers=os.environ["WS_SERVERS"].split(","))
    metrics = sender.publish(1)
    dropped = dict(sender.last_dropped)
    # Version 2 off the critical path: every rank gathers now, then trains on (changes its shards) while
    # rank 0's thread still sends; the receivers must get the weights of the call, not the later ones.
    _perturb(model)
    assert sender.publish(2, background=True) == {}
    _perturb(model)
    background = sender.wait()
    if rank == 0:
        out = {"metrics": metrics, "dropped": dropped, "background": background, "dropped2": sender.last_dropped}
        Path(os.environ["WS_OUT"]).write_text(json.dumps(out))
        sender.close()
    dist.destroy_process_group()


def test_fsdp2_sharded_learner_publishes_full_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.weight_receiver import ModelEngine, ReceiverProcess
    from weight_sync.snapshot import latest_snapshot, read_snapshot, snapshot_dir

    config = tmp_path / "tether.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"run_id": "fsdp", "output_dir": str(tmp_path / "runs")},
                "weight_sync": {
                    "transport": {"type": "gloo", "master_port": 0},
                    "bucket_size_mb": 0.1,
                    # Version 1 has no snapshot due, so its 128x128-and-larger tensors travel as full_tensor()
                    # gave them (direct segments); version 2's snapshot packs every bucket.
                    "direct_tensor_mb": 0.03,
                    "snapshot_every": 2,
                    "verify_checksums": True,
                    "prepare_timeout_s": 10,
                    "transfer_timeout_s": 30,
                    "commit_timeout_s": 30,
                },
            }
        )
    )
    receivers = [ReceiverProcess(config=config, model=tiny_model_dir, workdir=tmp_path) for _ in range(2)]
    out = tmp_path / "rank0.json"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "WS_CONFIG": str(config),
        "WS_MODEL": str(tiny_model_dir),
        "WS_OUT": str(out),
        "OMP_NUM_THREADS": "1",
        "WS_SERVERS": ",".join(r.address for r in receivers),
    }
    try:
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        logs = [p.communicate(timeout=180)[0] for p in ranks]
        assert all(p.returncode == 0 for p in ranks), "\n".join(log[-3000:] for log in logs)
    finally:
        for r in receivers:
            r.stop()
    result = json.loads(out.read_text())
    # verify_checksums: a receiver counts as reached only when its loaded tensors' sums match the learner's.
    assert result["metrics"]["weight_sync/reached"] == 2, result["dropped"]
    assert result["background"]["weight_sync/reached"] == 2, result["dropped2"]
    assert (result["metrics"]["weight_sync/background"], result["background"]["weight_sync/background"]) == (0, 1)
    assert (result["metrics"]["weight_sync/snapshot"], result["background"]["weight_sync/snapshot"]) == (0, 1)
    expected = ModelEngine.from_path(tiny_model_dir).model
    snapshots = tmp_path / "runs" / "fsdp" / "snapshots"
    _perturb(expected)
    _perturb(expected)  # the weights version 2 was published with
    full = dict(expected.named_parameters())
    loaded = dict(read_snapshot(snapshot_dir(snapshots, 2)))
    assert set(loaded) == set(full)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, full[name], rtol=0, atol=0)
    assert latest_snapshot(snapshots)[0] == 2


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    worker()
