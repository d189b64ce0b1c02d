"""Learner tokens/s of three batch layouts on RL-like lengths, each lever measured alone.

    python bench/learner.py [--quick] [--steps N]

Same model (every copy loads the same weights), same groups, same process, the same tokens trained on:
completion lengths are long-tailed (log-uniform 16..1024 tokens), which is where padding to the longest
sequence of a micro-batch wastes most compute. Three layouts, each its own ``Trainer``:

* ``padded_fixed``: ``micro_batch_size_per_gpu`` sequences in dataset order, right-padded to the
  micro-batch's longest (verl with ``use_dynamic_bsz: false``, ``use_remove_padding: false``);
* ``padded_dynamic``: sequences in order of length, each micro-batch as many as fit
  ``max_token_len_per_gpu`` padded slots (rows x its longest), so like lengths share a micro-batch and
  little is padded (``use_dynamic_bsz`` without remove-padding — stronger than verl's own, which pads
  every row to the batch's longest; until 2026-11-26 tether's planner balanced tokens across these
  micro-batches, which put a long sequence in each and made this layout slower than ``padded_fixed``);
* ``packed``: the same token budget, sequences packed into one row attending within each sequence
  only (``use_remove_padding``; :mod:`learner.varlen_attention` on CPU).

Figures: ``learner/packed_vs_padded_dynamic`` (the remove-padding lever alone, goal ≥ 1.0: packing must
not lose to the strongest padded layout; what it can win is what that layout pads, which the script prints
— 17 % of its slots on 2026-11-26, so the 1.5 this goal was before, set against the old planner's padded
layout, is out of reach for a fair one),
``learner/padded_dynamic_vs_padded_fixed`` (the dynamic-batch lever alone, no goal) and
``learner/packed_vs_padded_fixed`` (both levers, no goal). All run forward + backward of the real
policy loss and the optimizer step. Every step trains one batch on all three, the order rotating from
step to step so that load from other processes hits each alike; a ratio is taken per step (same batch:
time ratio = tokens/s ratio), the figure is the median over ≥ 3 steps with the min–max. The LM head:
packed rows compute it only where a completion token is predicted; padded micro-batches compute it from
the first column any row needs on (the shared prompt columns are skipped, see
:func:`learner.logprobs.forward_micro_batch`), so on pad positions past a short row's end it is still
paid — that is the price of padding, which is what is measured. Prints MFU on GPU. Timing is never
asserted anywhere; a test only runs --quick.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report

# name -> (use_remove_padding, use_dynamic_bsz)
LAYOUTS = {"padded_fixed": (False, False), "padded_dynamic": (False, True), "packed": (True, True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model and batch (seconds on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per layout")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.telemetry import peak_flops, train_flops
    from learner.trainer import Trainer
    from tether.commands.tiny_model import make_tiny_model
    from tether.config import TetherConfig
    from tether.redis_server import free_port

    quick = args.quick
    steps = max(3, args.steps or (3 if quick else 6))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    hidden, layers, heads = (64, 2, 2) if quick else ((1024, 8, 16) if cuda else (256, 4, 4))
    max_len = 256 if quick else 1024
    n_groups, group_size = (4, 4) if quick else ((32, 8) if cuda else (4, 8))
    micro_batch = 8
    budget = 2048 if quick else (16384 if cuda else int(os.environ.get("BENCH_BUDGET", "2048")))
    layouts = LAYOUTS
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(tmp, hidden=hidden, layers=layers, heads=heads, max_position=2048)

        def groups(n: int, seed: int):
            return make_groups(n, group_size, vocab=256, seed=seed, completion_len=(16, max_len), log_uniform=True)

        # Full size: the first step at a new size pays allocator growth and page faults, kept out of the timing.
        warmup = groups(n_groups, seed=10_000)
        batches = [groups(n_groups, seed=s) for s in range(steps)]
        trainers = {}
        for name, (packed, dynamic) in layouts.items():
            cfg = TetherConfig.model_validate(
                {
                    "model": {"path": str(model_dir)},
                    "rollout": {"max_tokens": max_len},
                    "learner": {
                        "train_batch_size": n_groups,
                        "use_remove_padding": packed,
                        "use_dynamic_bsz": dynamic,
                        "micro_batch_size_per_gpu": micro_batch,
                        "max_token_len_per_gpu": budget,
                        "lr": 1e-5,
                        # the layouts of padding alone: prompts copied per sample on every side (what sharing
                        # them is worth is bench/real_model.py's figure)
                        "share_prompts": False,
                    },
                }
            )
            model = parallelize(load_model(cfg, device), cfg, device)
            trainers[name] = Trainer(cfg, model, device=device, ref_model=None)
            trainers[name].train_step(warmup, version=0)
        tokens = dict.fromkeys(layouts, 0.0)
        seconds = dict.fromkeys(layouts, 0.0)
        took_by_step = []
        for k, batch in enumerate(batches):
            took = {}
            # Rotate which layout goes first so none always runs right after another.
            for name in ordered(list(layouts), k):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = trainers[name].train_step(batch, version=0)
                if cuda:
                    torch.cuda.synchronize()
                took[name] = time.perf_counter() - t0
                seconds[name] += took[name]
                tokens[name] += out["learner/tokens"]
            took_by_step.append(took)
        n_params = sum(p.numel() for p in trainers["packed"].model.parameters())
        results = {name: (tokens[name] / seconds[name], tokens[name], seconds[name], n_params) for name in layouts}
        real_share = {"fixed": _padded_real_share(batches, micro_batch),
                      "dynamic": _padded_real_share(batches, micro_batch, budget)}  # fmt: skip
        del trainers
        dist.destroy_process_group()
    peak = peak_flops(device)
    for name, (tps, tokens, seconds, n_params) in results.items():
        line = f"{name:>14}: {tps:10.0f} tokens/s ({tokens:.0f} tokens in {seconds:.2f}s)"
        if peak:
            mfu = train_flops(n_params, int(tokens), forward_passes=1) / (seconds * peak)
            line += f"  MFU {100 * mfu:.1f}%"
        print(line)
    for kind, share in real_share.items():
        print(f"padded_{kind} layout: {100 * share:.0f}% of its token slots are real tokens")
    where = f"{device.type}, lengths 16..{max_len} log-uniform, budget {budget} tokens, micro-batch {micro_batch}"
    pairs = (
        ("packed", "padded_dynamic", 1.0, "padded micro-batches by token budget (verl use_dynamic_bsz, no rmpad)"),
        ("padded_dynamic", "padded_fixed", None, f"padded fixed micro-batches of {micro_batch} sequences"),
        ("packed", "padded_fixed", None, f"padded fixed micro-batches of {micro_batch} sequences"),
    )
    for measured, base, goal, words in pairs:
        # Same batch on both sides of a step: the time ratio is the tokens/s ratio.
        ratios = [t[base] / t[measured] for t in took_by_step]
        report(
            figure(
                f"learner/{measured}_vs_{base}",
                ratios,
                goal=goal,
                direction="min",
                baseline=f"{words}; tokens/s, {where}",
            ),
            quick=quick,
        )
    return 0


def _padded_real_share(batches: list, micro_batch: int, budget: int | None = None) -> float:
    """Real tokens / computed slots of a padded layout (one mini-batch per step, one rank): fixed micro-batches
    of ``micro_batch`` samples in order, or with ``budget`` the trainer's own dynamic plan."""
    from learner.packing import plan_micro_batches

    real = slots = 0
    for batch in batches:
        lengths = [t.prompt_token_ids.shape[0] + t.num_completion_tokens for g in batch for t in g.trajectories]
        (plan,) = plan_micro_batches(lengths, world_size=1, dynamic=budget is not None, max_tokens=budget or 1,
                                     micro_batch_size=micro_batch, padded=True)  # fmt: skip
        for mb in plan:
            chunk = [lengths[i] for i in mb]
            real += sum(chunk)
            slots += len(chunk) * max(chunk, default=0)
    return real / slots


if __name__ == "__main__":
    sys.exit(main())
