"""Learning curves of PPO with a critic (``adv_estimator: gae``) against GRPO on the demo task, same samples.

Each estimator runs ``configs/demo.yaml`` (the ``charclass`` task, the demo's tiny model) once per seed as
a real ``tether up``; the order alternates from seed to seed so drift of a shared machine favours neither.
Printed: mean training reward (``reward/mean``) over the last ``--tail`` steps per run, mean ± std over
seeds, the ratio GAE ÷ GRPO of the same seed (a figure for ``make bench``), the critic's explained
variance at the end, and wall seconds per run. Written to the output folder: ``curves.png`` (reward by
step, mean line and ± std band per estimator; the critic's explained variance) and ``results.json``.

    python bench/gae_vs_grpo.py                          # 2 estimators x 3 seeds x 60 steps; ~1 min per run
    python bench/gae_vs_grpo.py --out runs/bench-gae --steps 100
    python bench/gae_vs_grpo.py --quick                  # a smoke run: 4 steps, 1 seed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, ordered, tether_up  # noqa: E402
from bench.common import report as report_figure  # noqa: E402
from tether.metrics import read_metrics  # noqa: E402

ESTIMATORS = ("grpo", "gae")


def run_once(args: argparse.Namespace, *, estimator: str, seed: int, model: Path) -> dict:
    run_id = f"{estimator}-seed{seed}"
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run"].update(run_id=run_id, output_dir=str(args.out), seed=seed, loggers=["console"])
    cfg["model"]["path"] = str(model)
    cfg["learner"].update(total_steps=args.steps, export_hf=False, read_timeout_s=600)
    cfg["algorithm"]["adv_estimator"] = estimator
    if estimator == "gae":
        cfg["algorithm"].update(gamma=1.0, lam=args.lam)
        cfg["critic"] = {"optim": {"lr": args.critic_lr}, "critic_warmup": args.critic_warmup}
    print(f"seed {seed}: {estimator} ...", flush=True)
    run_dir = tether_up(cfg, out=args.out, run_id=run_id, what=f"{estimator}, seed {seed}")
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    return {
        "reward": [r["reward/mean"] for r in rows],
        "explained_var": [r.get("critic/vf_explained_var") for r in rows],
        "wall_s": rows[-1]["time"] - rows[0]["time"] + rows[0]["timing/step"],
    }


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def plot(results: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in results.items():
        n = min(len(r["reward"]) for r in runs)
        steps = list(range(1, n + 1))
        cols = [[r["reward"][i] for r in runs] for i in range(n)]
        mean = [statistics.fmean(c) for c in cols]
        std = [mean_std(c)[1] for c in cols]
        axes[0].plot(steps, mean, label=f"{name} ({len(runs)} seeds)")
        axes[0].fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                             [m + s for m, s in zip(mean, std, strict=True)], alpha=0.2)  # fmt: skip
        if name == "gae":
            for r in runs:
                axes[1].plot(steps, r["explained_var"][:n], alpha=0.7)
    axes[0].set_xlabel("learner step (equal samples per step)")
    axes[0].set_ylabel("training reward/mean")
    axes[0].legend()
    axes[1].set_xlabel("learner step")
    axes[1].set_ylabel("critic/vf_explained_var (one line per seed)")
    axes[1].set_ylim(-1.0, 1.0)  # the first steps of a fresh critic sit far below; the rise is what matters
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, 1 seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tail", type=int, default=10, help="final reward = mean over this many last steps")
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--critic-lr", type=float, default=3e-3)
    parser.add_argument("--critic-warmup", type=int, default=0)
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-demo", help="`make demo` makes it")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-gae-vs-grpo", help="run folders, plot")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.tail = 4, 1, 2
    if not (args.model / "config.json").exists():
        raise SystemExit(f"--model {args.model}: no model there — run `make demo` or "
                         f"`tether make-tiny-model {args.model} --hidden 64 --layers 2 --heads 2`")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {e: [] for e in ESTIMATORS}
    for seed in range(args.seeds):
        for est in ordered(ESTIMATORS, seed):
            results[est].append(run_once(args, estimator=est, seed=seed, model=args.model))

    final = {e: [statistics.fmean(r["reward"][-args.tail :]) for r in runs] for e, runs in results.items()}
    print(f"\n{args.seeds} seeds x {args.steps} steps of configs/demo.yaml; final = mean reward of the last "
          f"{args.tail} steps")  # fmt: skip
    for e in ESTIMATORS:
        m, s = mean_std(final[e])
        wall = statistics.fmean(r["wall_s"] for r in results[e])
        first = statistics.fmean(r["reward"][0] for r in results[e])
        print(f"{e:<6} final reward {m:.3f}±{s:.3f}  (first step {first:.3f})  wall {wall:.0f}s per run")
    ev = [r["explained_var"][-1] for r in results["gae"]]
    print(f"gae    critic explained variance at the last step: {', '.join(f'{x:.2f}' for x in ev)}")
    ratios = [g / max(b, 1e-9) for g, b in zip(final["gae"], final["grpo"], strict=True)]
    report_figure(figure("learning/gae_final_reward_vs_grpo", ratios, goal=None, direction="min",
                         baseline="final training reward of GRPO (configs/demo.yaml) of the same seed"),
                  quick=args.quick)  # fmt: skip
    plot(results, args.out / "curves.png")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"plot: {args.out / 'curves.png'}")


if __name__ == "__main__":
    main()
