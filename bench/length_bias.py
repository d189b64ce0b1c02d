"""Length bias of the staleness bound: does the learner train on the completion lengths that were generated?

A group is too old to train on once its oldest token is more than ``algorithm.max_staleness`` versions
behind the learner. Long completions arrive last, so a learner that trains on whatever arrived first lets
exactly those age past the bound, and they are dropped: the trained lengths skew short. tether's learner
instead waits (``algorithm.stale_wait_s``) for the groups that would pass the bound, and takes what is
available oldest first (docs/STALENESS.md). This bench measures both on a workload with long-tailed
completion lengths (``demo:longtail``: Pareto caps from 4 tokens, median 8, one in sixteen ≥ 64, capped at
256, on the random tiny byte-level model), each a real ``tether up``:

- **sync** (``max_staleness: 0``): the on-policy reference for learning per step;
- for each ``max_staleness`` η in ``--staleness`` (default 1 2 4): **no wait** (``stale_wait_s: 0``: train
  on what arrived first — what tether did before, and what a learner that drops stale data does) and
  **wait** (the default).

Per run, from the run's length book (``buffer_stats.json``, :mod:`buffer.lengths`): the total-variation
distance between the length distributions generated and trained (half-octave buckets), the share of
groups dropped as stale, the trained samples/s (learner steps after ``--skip``), and the held-out reward
at the end (greedy, ``demo:longtail`` validation prompts). Figures, each a median over repeats with its
min–max: ``length_bias/tv_wait_s{η}`` (goal ≤ 0.05) beside ``length_bias/tv_nowait_s{η}`` (no goal: the
figure before), ``length_bias/samples_per_s_s{η}`` and ``length_bias/tokens_per_s_s{η}`` = trained samples/s
(tokens/s) wait ÷ no wait of the same seed (goal ≥ 0.95 each; where generation is the bottleneck, keeping the
long samples must cost samples/s in proportion to their extra tokens, so tokens/s is the one that says
whether waiting wasted the machine), and ``length_bias/heldout_s{η}`` = held-out reward wait − sync of the
same repeat (no goal; read beside the spread of sync's own, printed). Each repeat uses its own seed for
every mode; the order of the modes rotates from repeat to repeat.

    python bench/length_bias.py            # ~25 minutes on 2 CPU cores
    python bench/length_bias.py --quick    # a smoke run (one η, few steps): not a measurement
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, ordered, report, tether_up  # noqa: E402
from tether.metrics import read_metrics  # noqa: E402


def run(args: argparse.Namespace, *, mode: str, staleness: int, seed: int, model: Path, out: Path) -> dict:
    run_id = f"lb-{mode}-s{staleness}-seed{seed}"
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(out), "seed": seed, "loggers": ["console"]},
        "model": {"path": str(model)},
        "rollout": {"engine": {"type": "transformers", "max_num_seqs": 128}, "reward": {"type": "demo"},
                    "n": args.n, "max_tokens": 256, "num_servers": 1, "prompt_workers": args.batch},
        "learner": {"total_steps": args.steps, "train_batch_size": args.batch, "lr": args.lr,
                    "data_path": "demo:longtail", "checkpoint_every": 0, "export_hf": False,
                    "val_data_path": "demo:longtail", "test_freq": args.steps, "val_max_prompts": args.val_prompts,
                    "val_max_tokens": 16},
        "algorithm": {"max_staleness": staleness, **({"stale_wait_s": 0} if mode == "nowait" else {})},
        "weight_sync": {"transport": {"type": "gloo", "master_port": 0}},
    }  # fmt: skip
    print(f"seed {seed}: {mode} max_staleness={staleness} ...", flush=True)
    run_dir = tether_up(cfg, out=out, run_id=run_id)
    rows = read_metrics(run_dir / "metrics.jsonl")
    books = json.loads((run_dir / "buffer_stats.json").read_text())
    steps = [r for r in rows if r.get("learner/samples") is not None][args.skip :]
    val = [r["val/reward_mean"] for r in rows if r.get("val/reward_mean") is not None]
    groups = books["buffer/acknowledged"] + books["buffer/dropped_stale"]
    return {
        "tv": books.get("buffer/length_tv", 0.0),
        "mean_generated": books.get("buffer/length_mean_generated", 0.0),
        "mean_trained": books.get("buffer/length_mean_trained", 0.0),
        "dropped": books["buffer/dropped_stale"] / groups if groups else 0.0,
        "samples_per_s": sum(r["learner/samples"] for r in steps) / sum(r["timing/step"] for r in steps),
        "tokens_per_s": sum(r["learner/tokens"] for r in steps) / sum(r["timing/step"] for r in steps),
        "staleness": books.get("buffer/staleness_mean", 0.0),
        "heldout": val[-1] if val else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="steps excluded from timing (start-up)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per learner step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-prompts", type=int, default=48)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--out", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.skip, args.batch, args.n, args.val_prompts = 4, 1, 4, 2, 4
        args.staleness, args.repeats = [1], 1
    from tether.commands.tiny_model import make_tiny_model

    modes = [("sync", 0)] + [(m, s) for s in args.staleness for m in ("nowait", "wait")]
    runs: dict[tuple[str, int], list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="tether-length-bias-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(out / "model", hidden=64, layers=2, heads=2)
        for seed in range(args.repeats):
            for mode, staleness in ordered(modes, seed):
                runs[mode, staleness].append(run(args, mode=mode, staleness=staleness, seed=seed, model=model, out=out))

    print(f"\ndemo:longtail, {args.batch} prompts x {args.n} samples a step, {args.steps} steps, tiny model 64x2")
    print(f"{'mode':<12}{'TV':>7}{'len gen':>9}{'len trained':>12}{'dropped':>9}{'samples/s':>10}{'tokens/s':>9}"
          f"{'staleness':>10}{'held-out':>9}")  # fmt: skip
    for (mode, s), rs in runs.items():
        for r in rs:
            print(f"{f'{mode} s{s}':<12}{r['tv']:>7.3f}{r['mean_generated']:>9.1f}{r['mean_trained']:>12.1f}"
                  f"{r['dropped']:>9.1%}{r['samples_per_s']:>10.1f}{r['tokens_per_s']:>9.0f}{r['staleness']:>10.2f}"
                  f"{r['heldout']:>9.3f}")  # fmt: skip
    sync = [r["heldout"] for r in runs["sync", 0]]
    print(f"sync held-out reward: median {statistics.median(sync):.3f}, min-max {min(sync):.3f}-{max(sync):.3f}")
    work = f"demo:longtail, {args.batch}x{args.n} samples/step, {args.steps} steps"
    for s in args.staleness:
        wait, nowait = runs["wait", s], runs["nowait", s]
        report(figure(f"length_bias/tv_wait_s{s}", [r["tv"] for r in wait], goal=0.05, direction="max",
                      baseline=f"the lengths generated in the same run (max_staleness {s}, waiting); {work}"),
               quick=args.quick)  # fmt: skip
        report(figure(f"length_bias/tv_nowait_s{s}", [r["tv"] for r in nowait], goal=None, direction="max",
                      baseline=f"the lengths generated in the same run (max_staleness {s}, stale_wait_s 0)"),
               quick=args.quick)  # fmt: skip
        for unit in ("samples", "tokens"):
            ratios = [w[f"{unit}_per_s"] / n[f"{unit}_per_s"] for w, n in zip(wait, nowait, strict=True)]
            baseline = f"trained {unit}/s with stale_wait_s 0, same seed; {work}"
            fig = figure(f"length_bias/{unit}_per_s_s{s}", ratios, goal=0.95, direction="min", baseline=baseline)
            report(fig, quick=args.quick)
        gaps = [w["heldout"] - y["heldout"] for w, y in zip(wait, runs["sync", 0], strict=True)]
        report(figure(f"length_bias/heldout_s{s}", gaps, goal=None, direction="min",
                      baseline="held-out reward of max_staleness 0 (sync), same seed"), quick=args.quick)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({f"{m}-s{s}": rs for (m, s), rs in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
