"""Peak activation memory per rank at a long packed row: Ulysses SP = 2 against SP = 1, two real ranks.

    python bench/ulysses.py [--quick] [--repeats N] [--tokens T]

Two processes (gloo on CPU, NCCL on GPU) each load the same model and run forward + backward of the
log-probs of the same packed row (4 sequences, ``--tokens`` in all): with SP = 1 each rank holds the
whole row, as a data-parallel rank does; with SP = 2 the two ranks form one group and each holds half
the tokens (:mod:`learner.ulysses`). FSDP is left out so that parameters are plain tensors a rank
holds either way; sharding does not change what SP does to activations.

Activation memory is counted exactly, the same way on CPU and GPU: the bytes of the distinct storages
autograd saves for backward during the forward (parameters excluded), which is what a rank holds at
the forward/backward turn. On GPU the script also prints ``max_memory_allocated`` above the weights.
Each repeat measures both sides, the order alternating; the figure is the median SP1/SP2 ratio of the
larger rank's bytes, with the min–max. Counted bytes do not vary between repeats; the repeats show it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report


def _activation_bytes(model, mb, layout, device) -> tuple[int, int]:
    """(bytes saved for backward, GPU peak above the start or 0) of one forward + backward."""
    import torch

    from learner.logprobs import forward_micro_batch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _ = forward_micro_batch(model, mb, device=device, sp=layout)
    logprobs.sum().backward()
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() - start if cuda else 0
    return sum(seen.values()), peak


def _worker(rank: int, port: int, model_dir: str, tokens: int, repeats: int, out: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from learner import ulysses
    from learner.packing import Sample, make_micro_batch
    from learner.parallelize import load_model
    from tether.config import TetherConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    models, layouts = {}, {}
    for sp in (1, 2):
        cfg = TetherConfig.model_validate({"model": {"path": model_dir},
                                           "learner": {"ulysses_sequence_parallel_size": sp}})  # fmt: skip
        models[sp] = load_model(cfg, device).to(device)
        layout = ulysses.setup(sp, num_heads=models[sp].config.num_attention_heads)
        layouts[sp] = layout if sp > 1 else None
    rng = np.random.default_rng(0)
    n = tokens // 4
    samples = [
        Sample(input_ids=rng.integers(0, 256, n), prompt_len=16, behavior_logprobs=np.zeros(n - 16),
               loss_mask=np.ones(n - 16))
        for _ in range(4)
    ]  # fmt: skip
    mb = make_micro_batch(samples, list(range(4)), packed=True)
    rows = []
    for r in range(repeats):
        row = {}
        for sp in ordered([1, 2], r):
            saved, peak = _activation_bytes(models[sp], mb, layouts[sp], device)
            both = torch.tensor([saved, peak], dtype=torch.float64, device=device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            row[sp] = both.tolist()
        rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short row and a small model (seconds on CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=None, help="tokens of the packed row (default 8192; quick 512)")
    args = p.parse_args(argv)

    import torch.multiprocessing as mp

    from tether.commands.tiny_model import make_tiny_model
    from tether.redis_server import free_port

    tokens = args.tokens or (512 if args.quick else 8192)
    hidden, layers = (128, 2) if args.quick else (256, 4)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", hidden=hidden, layers=layers, heads=4, kv_heads=2,
                                    max_position=max(2048, tokens))  # fmt: skip
        out = Path(tmp) / "rows.json"
        mp.spawn(_worker, args=(free_port(), str(model_dir), tokens, args.repeats, str(out)), nprocs=2)
        rows = json.loads(out.read_text())
    for k, row in enumerate(rows):
        sp1, sp2 = row["1"], row["2"]
        gpu = f"  GPU peak {sp1[1] / 2**20:.1f} vs {sp2[1] / 2**20:.1f} MiB" if sp1[1] else ""
        saved = f"SP=1 {sp1[0] / 2**20:.1f} MiB, SP=2 {sp2[0] / 2**20:.1f} MiB"
        print(f"repeat {k}: saved activations per rank {saved}{gpu}")
    report(
        figure(
            "ulysses/activation_memory_sp1_over_sp2",
            [row["1"][0] / row["2"][0] for row in rows],
            goal=None,
            direction="min",
            baseline=f"SP=1 (each rank holds the whole {tokens}-token packed row), same model and row, same run",
            note=f"hidden {hidden}, {layers} layers, 2 ranks; bytes autograd saves for backward, max over ranks",
        ),
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
