"""LoRA against full fine-tuning on the same model and batches: learner steps/s, and bytes per weight update.

    python bench/lora.py [--quick] [--steps N] [--rank R]

One process (gloo, or NCCL on a GPU), three ``Trainer``s on the 256-wide 4-layer tiny model (FSDP2, packed
rows): full fine-tuning (every weight in AdamW), ``model.lora`` (rank R adapters on every linear layer,
only they in AdamW) and the same with the tied embedding trained whole (``modules_to_save:
[embed_tokens]``, the ``configs/demo-lora.yaml`` recipe). Every step trains the same batch on all three,
the order rotating; a ratio is taken per step (LoRA steps/s over full) and the figure is the median with
the min–max. The update size is the weight sender's own layout of what it would send: all parameters, or
the adapters (and saved modules) (counted bytes, no timing, no spread). Timing is never asserted
anywhere; a test only runs ``--quick``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model and batch (seconds on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side (>= 3)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from learner.lora import adapter_params, is_lora
    from learner.parallelize import load_actor, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tether.commands.tiny_model import make_tiny_model
    from tether.config import TetherConfig
    from tether.redis_server import free_port
    from weight_sync.buckets import plan_layout

    steps = max(3, args.steps or (3 if args.quick else 6))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    hidden, layers, heads = (64, 2, 2) if args.quick else (256, 4, 4)
    lora = {"rank": args.rank, "alpha": 2 * args.rank}
    sides = {"full": None, "lora": lora, "lora_saved": {**lora, "modules_to_save": ["embed_tokens"]}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(tmp, hidden=hidden, layers=layers, heads=heads)
        batches = [make_groups(4, 8, vocab=256, seed=s, completion_len=(16, 256)) for s in range(steps + 1)]
        trainers, sent = {}, {}
        for name, lora in sides.items():
            cfg = TetherConfig.model_validate({"model": {"path": str(model_dir), "lora": lora},
                                               "rollout": {"max_tokens": 256},
                                               "learner": {"train_batch_size": 4, "lr": 1e-4}})  # fmt: skip
            torch.manual_seed(0)
            model = parallelize(load_actor(cfg, device), cfg, device)
            trainers[name] = Trainer(cfg, model, device=device, ref_model=None)
            trainers[name].train_step(batches[-1], version=0)  # warm-up, untimed
            params = adapter_params(model) if is_lora(model) else list(model.named_parameters())
            metas = [(n, t.dtype, tuple(t.shape)) for n, t in params]
            sent[name] = plan_layout(metas, bucket_size_bytes=2**20).num_bytes
        took = []
        for k, batch in enumerate(batches[:-1]):
            row = {}
            for name in ordered(list(sides), k):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                trainers[name].train_step(batch, version=0)
                if cuda:
                    torch.cuda.synchronize()
                row[name] = time.perf_counter() - t0
            took.append(row)
        del trainers
    dist.destroy_process_group()
    print(f"bytes per update: full {sent['full']}, LoRA rank {args.rank} {sent['lora']}, "
          f"with the embedding saved {sent['lora_saved']}")  # fmt: skip
    for side, extra in (("lora", ""), ("lora_saved", " + modules_to_save embed_tokens")):
        where = f"{device.type}, hidden {hidden}, {layers} layers, rank {args.rank} all-linear{extra}"
        speed = [t["full"] / t[side] for t in took]
        base = f"full fine-tuning, same model and batches, same run; {where}"
        fig = figure(f"{side}/steps_per_s_vs_full", speed, goal=None, direction="min", baseline=base)
        report(fig, quick=args.quick)
        base = f"a full update's bytes (counted, not timed); {where}"
        fig = figure(f"{side}/update_bytes_vs_full", [sent[side] / sent["full"]], goal=None, direction="max",
                     baseline=base)  # fmt: skip
        report(fig, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
