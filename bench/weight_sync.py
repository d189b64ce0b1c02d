"""Weight-sync bandwidth against the wire's own speed, measured in the same run.

    python bench/weight_sync.py [--quick] [--repeats N]

A full update (prepare over gRPC → gather + pack → bucketed gloo broadcast → commit: load into a live
transformers model) of a ~100M-parameter Qwen2-style model with random weights (``--quick``: the tiny
test model) to 1 and 2 standalone receiver processes, against two baselines on the same machine with
the same number of receivers:
  * ``raw``: one ``dist.broadcast`` of a single flat buffer of the same bytes (the ceiling), reused
    across rounds on both sides;
  * ``per-tensor``: one ``dist.broadcast`` per tensor followed by a ``barrier`` (what some peers do).
Ratios are bytes/s of tether over bytes/s of a baseline (higher is better; goal vs raw >= 0.8). The
``transfer`` column is the gather + pack + broadcast stage alone (no gRPC, no load). Timings here are
only comparable within one run.

Like with like: every timing is taken on the sending process and ends when every receiver holds the
bytes (tether: the Commit replies; raw: a barrier after the broadcast, since the root's broadcast can
return while the last bytes are still in socket buffers). The first round of each (connections, group
build, buffers touched for the first time) is reported apart (``first`` columns); the ratios are the
median of the ``--repeats`` rounds after it (steady state).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL_SIZES = {"quick": {"hidden": 128, "layers": 2, "heads": 4}, "full": {"hidden": 768, "layers": 16, "heads": 12}}


def model_kwargs(quick: bool) -> dict:
    size = MODEL_SIZES["quick" if quick else "full"]
    return {
        **size,
        "kv_heads": max(1, size["heads"] // 3) if not quick else 2,
        "intermediate": 2048 if not quick else 256,
    }


def peer(args: argparse.Namespace) -> int:
    """A baseline receiver: joins a plain gloo world and receives what ``run_baselines`` sends."""
    import torch
    import torch.distributed as dist

    # Shapes first: the root's first timed broadcast must not wait for this peer to import transformers.
    shapes = _shapes(args.model)
    flat = torch.empty(sum(int(torch.tensor(s).prod()) if s else 1 for s in shapes), dtype=torch.float32)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    for _ in range(args.repeats + 1):
        dist.broadcast(flat, src=0)
        dist.barrier()
    for _ in range(args.repeats + 1):
        for shape in shapes:
            dist.broadcast(torch.empty(shape, dtype=torch.float32), src=0)
            dist.barrier()
    dist.destroy_process_group()
    return 0


def _shapes(model_dir: str) -> list[tuple[int, ...]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [tuple(p.shape) for _, p in model.named_parameters()]


def run_baselines(model, model_dir: Path, receivers: int, repeats: int) -> tuple[float, float, float]:
    """Seconds of the first flat broadcast, then medians of the later ones and of per-tensor + barrier."""
    import torch
    import torch.distributed as dist

    from tether.redis_server import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    peers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--peer",
                "--init",
                init,
                "--rank",
                str(r + 1),
                "--world",
                str(receivers + 1),
                "--model",
                str(model_dir),
                "--repeats",
                str(repeats),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(receivers)
    ]
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=receivers + 1)
    params = [p.detach() for _, p in model.named_parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    raw, per_tensor = [], []
    for _ in range(repeats + 1):  # the first round warms the connections up (reported apart)
        start = time.perf_counter()
        dist.broadcast(flat, src=0)
        dist.barrier()  # ends when every peer has the bytes, as a tether update ends at their commit
        raw.append(time.perf_counter() - start)
    for i in range(repeats + 1):
        start = time.perf_counter()
        for p in params:
            dist.broadcast(p.contiguous(), src=0)
            dist.barrier()
        if i:
            per_tensor.append(time.perf_counter() - start)
    dist.destroy_process_group()
    for p in peers:
        p.wait(60)
    return raw[0], statistics.median(raw[1:]), statistics.median(per_tensor)


def run_tether(model, model_dir: Path, workdir: Path, receivers: int, repeats: int) -> dict[str, float]:
    """Seconds of the first update; medians of later full updates and their stages; the group build."""
    import yaml

    from tether.config.loader import load_config
    from weight_sync.sender import WeightSender
    from weight_sync.standalone import ReceiverProcess

    config = workdir / f"bench-{receivers}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"run_id": "bench", "output_dir": str(workdir / "runs")},
                "weight_sync": {
                    "transport": {"type": "gloo", "master_port": 0},
                    "snapshot_every": 0,
                    "bucket_size_mb": 64,
                    "prepare_timeout_s": 60,
                    "transfer_timeout_s": 300,
                    "commit_timeout_s": 300,
                },
            }
        )
    )
    cfg = load_config(config)
    procs = [ReceiverProcess(config=config, model=model_dir, workdir=workdir, timeout_s=300) for _ in range(receivers)]
    sender = WeightSender(cfg, model=model, servers=[p.address for p in procs])
    try:
        rounds = []
        for version in range(1, repeats + 2):
            metrics = sender.publish(version)
            if metrics["weight_sync/reached"] != receivers:
                raise RuntimeError(f"update {version} reached {metrics['weight_sync/reached']}: {sender.last_dropped}")
            rounds.append(metrics)
        steady = {
            stage: statistics.median(m[f"weight_sync/{stage}"] for m in rounds[1:])
            for stage in ("seconds", "prepare_seconds", "transfer_seconds", "commit_seconds")
        }
        return {
            **steady,
            "first": rounds[0]["weight_sync/seconds"],
            "rebuild": rounds[0]["weight_sync/group_rebuild_seconds"],
        }
    finally:
        sender.close()
        for p in procs:
            p.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.peer:
        return peer(args)

    import torch

    from tether.tiny_model import make_tiny_model
    from weight_sync.standalone import ModelEngine

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory(prefix="tether-bench-ws-") as tmp:
        workdir = Path(tmp)
        model_dir = make_tiny_model(workdir / "model", seed=0, **model_kwargs(args.quick))
        model = ModelEngine.from_path(model_dir).model
        nparams = sum(p.numel() for p in model.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(
            f"model: {nparams / 1e6:.1f}M parameters, {nbytes / 2**20:.1f} MiB float32; gloo on loopback; "
            f"median of {args.repeats}"
        )
        header = (
            f"{'receivers':>9} {'tether MB/s':>12} {'transfer MB/s':>14} {'raw MB/s':>9} {'per-tensor MB/s':>16}"
            f" {'vs raw':>7} {'transfer vs raw':>16} {'vs per-tensor':>14} {'first tether s':>15}"
            f" {'first raw s':>12} {'first vs raw':>13} {'group build s':>14}"
        )
        rows, stages = [], []
        for receivers in (1, 2):
            t = run_tether(model, model_dir, workdir, receivers, args.repeats)
            raw_first, raw, per_tensor = run_baselines(model, model_dir, receivers, args.repeats)
            mb = nbytes / 1e6
            total = t["seconds"]
            rows.append(
                f"{receivers:>9} {mb / total:>12.1f} {mb / t['transfer_seconds']:>14.1f} {mb / raw:>9.1f} "
                f"{mb / per_tensor:>16.1f} {raw / total:>7.2f} {raw / t['transfer_seconds']:>16.2f} "
                f"{per_tensor / total:>14.2f} {t['first']:>15.3f} {raw_first:>12.3f} "
                f"{raw_first / t['first']:>13.2f} {t['rebuild']:>14.3f}"
            )
            stages.append(
                f"{receivers:>9} {total:>8.3f} {t['prepare_seconds']:>10.3f} {t['transfer_seconds']:>11.3f} "
                f"{t['commit_seconds']:>9.3f} {raw:>7.3f}"
            )
        # The ratio table comes last: tests/integration/test_weight_sync_bench.py reads the rows after it.
        print("steady-state seconds per stage (median)")
        print(f"{'n':>9} {'update':>8} {'prepare':>10} {'transfer':>11} {'commit':>9} {'raw':>7}")
        print("\n".join(stages))
        print(header)
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
