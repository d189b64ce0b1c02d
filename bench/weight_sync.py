"""Weight-sync bandwidth against the wire's own speed and against the peers' pattern, in the same run.

    python bench/weight_sync.py [--quick] [--repeats N] [--direct-tensor-mb MB]

A full tether update (prepare over gRPC → gather → gloo broadcast of each bucket's segments: tensors of
at least ``direct_tensor_mb`` straight from the parameters, the rest packed → commit: load into a live
transformers model by adoption) of a ~100M-parameter Qwen2-style model with random weights (``--quick``: the
tiny test model) to 1 and 2 standalone receiver processes, against two baselines sent from the same
process to the same number of plain receiver processes:

* ``raw``: one ``dist.broadcast`` of a single flat buffer of the same bytes, reused across rounds on
  both sides — the wire's ceiling, with nothing to pack and nothing to load;
* ``per-param``: one ``dist.broadcast`` per parameter with **no barrier** between them, into tensors the
  receiver already holds — what TRL and PipelineRL do (the pattern a peer would actually use).

Tether's other path runs beside it in the same rounds, to its own receivers: whole buckets
(``direct_tensor_mb: 0``: every tensor packed, one broadcast per bucket) against the default segments
(tensors of at least ``direct_tensor_mb`` broadcast from the parameters themselves), so the default is
the faster of the two as measured side by side.

Figures (bytes/s of tether over bytes/s of a baseline = baseline seconds / tether seconds):
``weight_sync/update_vs_raw_<n>recv`` (goal ≥ 0.8), ``weight_sync/update_vs_per_param_<n>recv``
(goal ≥ 1: tether is not slower than the peers' pattern) and, without a goal,
``weight_sync/transfer_vs_raw_<n>recv`` (the gather + pack + broadcast stage alone, no gRPC, no load)
and ``weight_sync/update_vs_whole_buckets_<n>recv`` (> 1: the default path is the faster).

Like with like: every timing is taken on the sending process and ends when every receiver holds the
bytes (tether: the Commit replies, i.e. loaded; baselines: one barrier after the last broadcast, since
the root's broadcast can return while the last bytes are still in socket buffers). Both sides' receivers
live through the whole run; each round runs every side once, in an order that rotates
from round to round. Rounds 0 and 1 are warm-up: round 0 makes the connections, builds the group and
touches buffers for the first time, and round 1 is the first update into a receiver's second receive
set (a receiver adopts one set as the live weights and receives the next update into the other, so
each set is first touched by one of the first two updates — a cost paid once per process, which put
one ~10x slower round among the timed ones before). Round 0 is reported apart (``first`` columns);
each figure is the median over ``--repeats`` later rounds of the per-round ratio, with its min–max.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report

RAW, PER_PARAM, STOP = 0, 1, -1  # commands the root broadcasts to the baseline peers

MODEL_SIZES = {"quick": {"hidden": 128, "layers": 2, "heads": 4}, "full": {"hidden": 768, "layers": 16, "heads": 12}}


def model_kwargs(quick: bool) -> dict:
    size = MODEL_SIZES["quick" if quick else "full"]
    return {
        **size,
        "kv_heads": max(1, size["heads"] // 3) if not quick else 2,
        "intermediate": 2048 if not quick else 256,
    }


def peer(args: argparse.Namespace) -> int:
    """A baseline receiver: joins a plain gloo world and receives what ``Baselines`` sends, until told to stop."""
    import torch
    import torch.distributed as dist

    # Buffers first: the root's first timed broadcast must not wait for this peer to import transformers.
    shapes = _shapes(args.model)
    flat = torch.empty(sum(_numel(s) for s in shapes), dtype=torch.float32)
    params = [torch.empty(s, dtype=torch.float32) for s in shapes]  # a receiver's model holds these already
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    command = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.broadcast(command, src=0)
        if int(command) == STOP:
            break
        if int(command) == RAW:
            dist.broadcast(flat, src=0)
        else:
            for t in params:
                dist.broadcast(t, src=0)
        dist.barrier()
    dist.destroy_process_group()
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shapes(model_dir: str) -> list[tuple[int, ...]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [tuple(p.shape) for _, p in model.named_parameters()]


class Baselines:
    """Rank 0 of a plain gloo world with ``receivers`` peer processes; times one raw or per-param round."""

    def __init__(self, model, model_dir: Path, receivers: int) -> None:
        import torch
        import torch.distributed as dist

        from tether.redis_server import free_port

        init = f"tcp://127.0.0.1:{free_port()}"
        self.peers = [
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
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for r in range(receivers)
        ]
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=receivers + 1)
        self.params = [p.detach().contiguous() for _, p in model.named_parameters()]
        self.flat = torch.cat([p.reshape(-1) for p in self.params])

    def round(self, kind: int) -> float:
        """Seconds from the first byte sent until every peer holds all of them."""
        import torch
        import torch.distributed as dist

        dist.broadcast(torch.tensor([kind], dtype=torch.int64), src=0)  # before the clock starts
        start = time.perf_counter()
        if kind == RAW:
            dist.broadcast(self.flat, src=0)
        else:
            for p in self.params:  # no barrier in between: TRL's and PipelineRL's loop
                dist.broadcast(p, src=0)
        dist.barrier()  # ends when every peer has the bytes, as a tether update ends at their commit
        return time.perf_counter() - start

    def close(self) -> None:
        import torch
        import torch.distributed as dist

        dist.broadcast(torch.tensor([STOP], dtype=torch.int64), src=0)
        dist.destroy_process_group()
        for p in self.peers:
            p.wait(60)


class Tether:
    """A ``WeightSender`` with ``receivers`` standalone receiver processes; times one full update."""

    def __init__(
        self, model, model_dir: Path, workdir: Path, receivers: int, *, direct_tensor_mb: float | None = None
    ) -> None:
        import yaml

        from tests.weight_receiver import ReceiverProcess
        from tether.config.loader import load_config
        from weight_sync.sender import WeightSender

        direct = {} if direct_tensor_mb is None else {"direct_tensor_mb": direct_tensor_mb}
        config = workdir / f"bench-{receivers}-{direct_tensor_mb}.yaml"
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
                        **direct,
                    },
                }
            )
        )
        self.receivers = receivers
        self.procs = [
            ReceiverProcess(config=config, model=model_dir, workdir=workdir, timeout_s=300) for _ in range(receivers)
        ]
        self.sender = WeightSender(load_config(config), model=model, servers=[p.address for p in self.procs])
        self.version = 0

    def round(self) -> dict[str, float]:
        self.version += 1
        metrics = self.sender.publish(self.version)
        if metrics["weight_sync/reached"] != self.receivers:
            raise RuntimeError(
                f"update {self.version} reached {metrics['weight_sync/reached']}: {self.sender.last_dropped}"
            )
        return metrics

    def close(self) -> None:
        self.sender.close()
        for p in self.procs:
            p.stop()


def measure(
    model, model_dir: Path, workdir: Path, receivers: int, repeats: int, direct_tensor_mb: float | None = None
) -> list[dict[str, float]]:
    """Rounds 0 and 1 (warm-up) then ``repeats`` rounds; each times every side once, order rotating.
    Sides: tether, tether sending whole buckets (``direct_tensor_mb: 0``; left out when tether already
    does), raw and per-param. Returns round 0 and the timed rounds."""
    sides: dict[str, Tether] = {}
    try:
        sides["tether"] = Tether(model, model_dir, workdir, receivers, direct_tensor_mb=direct_tensor_mb)
        if direct_tensor_mb != 0:
            sides["buckets"] = Tether(model, model_dir, workdir, receivers, direct_tensor_mb=0)
        baselines = Baselines(model, model_dir, receivers)
    except BaseException:
        for t in sides.values():
            t.close()
        raise
    rounds = []
    try:
        for k in range(repeats + 2):
            row: dict[str, float] = {}
            for side in ordered([*sides, "raw", "per_param"], k):
                if side in sides:
                    m = sides[side].round()
                    row[side] = m["weight_sync/seconds"]
                    if side == "tether":
                        row["transfer"] = m["weight_sync/transfer_seconds"]
                        row["prepare"] = m["weight_sync/prepare_seconds"]
                        row["commit"] = m["weight_sync/commit_seconds"]
                        row["rebuild"] = m["weight_sync/group_rebuild_seconds"]
                else:
                    row[side] = baselines.round(RAW if side == "raw" else PER_PARAM)
            rounds.append(row)
    finally:
        baselines.close()
        for t in sides.values():
            t.close()
    return [rounds[0], *rounds[2:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds after the warm-up (default 5; >= 3)")
    parser.add_argument(
        "--direct-tensor-mb",
        type=float,
        default=None,
        help="weight_sync.direct_tensor_mb for tether's side (default: the config default; 0: whole buckets)",
    )
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        return peer(args)
    args.repeats = max(3, args.repeats or (3 if args.quick else 5))

    import torch

    from tests.weight_receiver import ModelEngine
    from tether.commands.tiny_model import make_tiny_model

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    figures = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-ws-") as tmp:
        workdir = Path(tmp)
        model_dir = make_tiny_model(workdir / "model", seed=0, **model_kwargs(args.quick))
        model = ModelEngine.from_path(model_dir).model
        nparams = sum(p.numel() for p in model.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        what = f"{nparams / 1e6:.1f}M params, {nbytes / 2**20:.1f} MiB float32, gloo on loopback"
        print(f"model: {what}; {args.repeats} rounds after a warm-up, order rotating")
        mb = nbytes / 1e6
        print(
            f"{'n':>3} {'tether MB/s':>12} {'buckets MB/s':>13} {'transfer MB/s':>14} {'raw MB/s':>9}"
            f" {'per-param MB/s':>15}"
            f" {'prepare s':>10} {'commit s':>9} {'first tether s':>15} {'first raw s':>12} {'group build s':>14}"
        )
        for receivers in (1, 2):
            first, *rounds = measure(model, model_dir, workdir, receivers, args.repeats, args.direct_tensor_mb)
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            print(
                f"{receivers:>3} {mb / med['tether']:>12.1f} {mb / med.get('buckets', math.nan):>13.1f}"
                f" {mb / med['transfer']:>14.1f} {mb / med['raw']:>9.1f}"
                f" {mb / med['per_param']:>15.1f} {med['prepare']:>10.3f} {med['commit']:>9.3f}"
                f" {first['tether']:>15.3f} {first['raw']:>12.3f} {first['rebuild']:>14.3f}"
            )
            tag = f"{receivers}recv"
            to = f"{receivers} receiver process{'es' if receivers > 1 else ''}, {what}"
            figures += [
                figure(
                    f"weight_sync/update_vs_raw_{tag}",
                    [r["raw"] / r["tether"] for r in rounds],
                    goal=0.8,
                    direction="min",
                    baseline=f"one raw dist.broadcast of the same bytes as one flat buffer to {to}",
                ),
                figure(
                    f"weight_sync/update_vs_per_param_{tag}",
                    [r["per_param"] / r["tether"] for r in rounds],
                    goal=1.0,
                    direction="min",
                    baseline=f"dist.broadcast per parameter, no barrier between (TRL / PipelineRL) to {to}",
                ),
                figure(
                    f"weight_sync/transfer_vs_raw_{tag}",
                    [r["raw"] / r["transfer"] for r in rounds],
                    goal=None,
                    direction="min",
                    baseline=f"one raw dist.broadcast (tether's gather + pack + broadcast stage only) to {to}",
                ),
            ]
            if "buckets" in med:
                figures.append(
                    figure(
                        f"weight_sync/update_vs_whole_buckets_{tag}",
                        [r["buckets"] / r["tether"] for r in rounds],
                        goal=None,
                        direction="min",
                        baseline=f"tether itself sending whole buckets (weight_sync.direct_tensor_mb: 0) to {to}",
                    )
                )
    print("columns: medians of the timed rounds; first: round 0 (connections, group build)")
    for f in figures:
        report(f, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
