"""Learning benchmark: does asynchrony cost learning? Synchronous vs asynchronous RL at equal samples.

Every mode (``algorithm.max_staleness`` 0 = synchronous, then 1, 2, 4 by default) runs the same RL
recipe — ``configs/addition.yaml`` from one warm-started tiny model, the same steps × prompts × samples —
once per seed, each a real ``tether up`` with evaluation on. The order of the modes alternates from seed to
seed, so slow drift of a shared machine does not favour one mode. Printed: held-out accuracy
(``val/mean@k``, on pairs never trained on) mean ± std over seeds at every evaluation step and by
wall-clock, final accuracy, wall time, and training samples/s; the ratio of each asynchronous mode's
samples/s to the synchronous run *of the same seed*, mean ± std over seeds. A PNG plots accuracy over
steps and over wall-clock (mean line, ± std band).

    python bench/learning.py                       # 4 modes x 3 seeds; about a minute per run on 2 CPU cores
    python bench/learning.py --model .cache/tiny-addition --seeds 5
    python bench/learning.py --quick               # a smoke run (tiny, untrained model: accuracy ~0)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, tether_up  # noqa: E402
from bench.common import report as report_figure  # noqa: E402
from tether.metrics import read_metrics  # noqa: E402

VAL_KEY = "val/mean@k"


def mode_order(modes: list[int], seed_index: int) -> list[int]:
    """Forward on even seeds, reversed on odd ones."""
    return list(modes) if seed_index % 2 == 0 else list(reversed(modes))


def run_once(args: argparse.Namespace, *, staleness: int, seed: int, model: Path, out: Path) -> dict:
    run_id = f"learning-s{staleness}-seed{seed}"
    cfg = yaml.safe_load((REPO / "configs" / "addition.yaml").read_text())
    cfg["run"].update(run_id=run_id, output_dir=str(out), seed=seed, loggers=["console"])
    cfg["model"]["path"] = str(model)
    cfg["rollout"].update(n=args.n, prompt_workers=args.batch)
    cfg["learner"].update(total_steps=args.steps, train_batch_size=args.batch, test_freq=args.test_freq,
                          val_max_prompts=args.val_prompts, export_hf=False, read_timeout_s=600)  # fmt: skip
    cfg["algorithm"]["max_staleness"] = staleness
    print(f"seed {seed}: max_staleness={staleness} ...", flush=True)
    run_dir = tether_up(cfg, out=out, run_id=run_id, what=f"max_staleness={staleness}, seed {seed}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r.get("learner/samples") is not None]
    # Wall-clock origin: the start of step 1 (the step's end time less its duration).
    t0 = train[0]["time"] - train[0]["timing/step"]
    end = {r["step"]: r["time"] - t0 for r in train}
    val = sorted(((r["step"], r[VAL_KEY]) for r in rows if r.get(VAL_KEY) is not None), key=lambda x: x[0])
    skip = min(args.skip, len(train) - 2)
    timed = train[skip + 1 :]
    wall = train[-1]["time"] - train[skip]["time"]
    return {
        "val": {step: acc for step, acc in val},
        "val_time": {step: end.get(step, 0.0) for step, _ in val},
        "samples_per_s": sum(r["learner/samples"] for r in timed) / wall if wall > 0 else 0.0,
        "wall_s": train[-1]["time"] - t0,
        "staleness_mean": statistics.fmean(r.get("staleness/mean") or 0.0 for r in train),
    }


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def fmt(xs: list[float], spec: str = ".3f") -> str:
    m, s = mean_std(xs)
    return f"{m:{spec}}±{s:{spec}}"


def figures(results: dict[int, list[dict]], *, quick: bool) -> None:
    """Into ``make bench``'s results: per asynchronous mode, samples/s and final held-out accuracy against the
    synchronous run of the same seed (the issue's claims: faster per second, not materially worse per sample)."""
    sync = results.get(0)
    if not sync:
        return
    for m in sorted(k for k in results if k):
        pairs = list(zip(results[m], sync, strict=True))
        speed = [a["samples_per_s"] / s["samples_per_s"] for a, s in pairs]
        sync_run = "the synchronous run (max_staleness 0) of the same seed"
        report_figure(figure(f"learning/async{m}_samples_per_s", speed, goal=1.0, direction="min", baseline=sync_run),
                      quick=quick)  # fmt: skip
        last = max(set.intersection(*(set(r["val"]) for r in results[m] + sync)))
        acc = [a["val"][last] / max(s["val"][last], 1e-9) for a, s in pairs]
        report_figure(figure(f"learning/async{m}_final_accuracy", acc, goal=0.95, direction="min",
                             baseline=f"held-out accuracy of the synchronous run of the same seed at step {last}"),
                      quick=quick)  # fmt: skip


def report(results: dict[int, list[dict]], args: argparse.Namespace) -> str:
    modes = sorted(results)
    steps = sorted(set.intersection(*(set(r["val"]) for runs in results.values() for r in runs)))
    lines = [f"held-out accuracy ({VAL_KEY}, mean±std over {len(results[modes[0]])} seeds) by learner step"]
    lines.append("(@ the mean wall-clock seconds since the start of step 1 at which that step ended)")
    lines.append(f"{'step':>6}" + "".join(f"{'staleness ' + str(m):>22}" for m in modes))
    for step in steps:
        at = {m: statistics.fmean(r["val_time"][step] for r in results[m]) for m in modes}
        cells = [f"{fmt([r['val'][step] for r in results[m]])} @{at[m]:.0f}s" for m in modes]
        lines.append(f"{step:>6}" + "".join(f"{c:>22}" for c in cells))
    lines.append("")
    lines.append(f"{'mode':<16}{'final acc':>14}{'wall s':>14}{'samples/s':>14}{'vs sync':>14}{'staleness':>10}")
    sync = results.get(0)
    for m in modes:
        runs = results[m]
        last = steps[-1]
        ratios = (
            [] if sync is None else [a["samples_per_s"] / s["samples_per_s"] for a, s in zip(runs, sync, strict=True)]
        )
        ratio = fmt(ratios, ".2f") if ratios else "-"
        name = "sync (0)" if m == 0 else f"async ({m})"
        lines.append(f"{name:<16}{fmt([r['val'][last] for r in runs]):>14}{fmt([r['wall_s'] for r in runs], '.0f'):>14}"
                     f"{fmt([r['samples_per_s'] for r in runs], '.1f'):>14}{ratio:>14}"
                     f"{statistics.fmean(r['staleness_mean'] for r in runs):>10.2f}")  # fmt: skip
    lines.append("vs sync: samples/s of the mode ÷ samples/s of the synchronous run of the same seed")
    return "\n".join(lines)


def plot(results: dict[int, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for m in sorted(results):
        runs = results[m]
        steps = sorted(set.intersection(*(set(r["val"]) for r in runs)))
        mean = [statistics.fmean(r["val"][s] for r in runs) for s in steps]
        std = [mean_std([r["val"][s] for r in runs])[1] for s in steps]
        times = [statistics.fmean(r["val_time"][s] for r in runs) for s in steps]
        label = "sync" if m == 0 else f"max_staleness {m}"
        for ax, xs in ((axes[0], steps), (axes[1], times)):
            ax.plot(xs, mean, marker=".", label=label)
            ax.fill_between(xs, [a - b for a, b in zip(mean, std, strict=True)],
                            [a + b for a, b in zip(mean, std, strict=True)], alpha=0.2)  # fmt: skip
    axes[0].set_xlabel("learner step (equal samples per step)")
    axes[1].set_xlabel("wall-clock s (mean over seeds)")
    axes[0].set_ylabel(f"held-out {VAL_KEY}")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (untrained tiny model)")
    parser.add_argument("--modes", default="0,1,2,4", help="max_staleness values; 0 (sync) is the baseline")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="prompts per learner step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--val-prompts", type=int, default=128)
    parser.add_argument("--skip", type=int, default=3, help="steps excluded from samples/s (start-up)")
    parser.add_argument("--model", type=Path, help="warm-started model (default: .cache/tiny-addition, else a new one)")
    parser.add_argument("--png", type=Path, default=Path("bench-learning.png"))
    parser.add_argument("--json", type=Path, help="also write the per-run results here")
    parser.add_argument("--out", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.modes, args.steps, args.batch, args.n, args.test_freq = "0,1", 4, 4, 4, 2
        args.val_prompts, args.skip, args.seeds = 8, 1, min(args.seeds, 2)
    modes = [int(m) for m in args.modes.split(",")]
    if 0 not in modes:
        raise SystemExit("--modes: include 0, the synchronous baseline every ratio is measured against")
    if args.seeds < 1:
        raise SystemExit("--seeds: at least 1")

    with tempfile.TemporaryDirectory(prefix="tether-learning-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = args.model
        cached = REPO / ".cache" / "tiny-addition"
        if model is None and not args.quick and (cached / "warm_start.json").exists():
            model = cached  # what `make demo-addition` made
        if model is None:
            from tether.commands.tiny_model import make_tiny_model

            model = make_tiny_model(out / "model", hidden=128, layers=2, heads=4)
            if not args.quick:
                from tether.commands.warm_start import warm_start

                warm_start(model, task="addition")
        results: dict[int, list[dict]] = {m: [] for m in modes}
        for i in range(args.seeds):
            for m in mode_order(modes, i):
                results[m].append(run_once(args, staleness=m, seed=i, model=model, out=out))  # seed order kept
    print(f"\n{args.seeds} seeds x modes {modes}: {args.steps} steps x {args.batch} prompts x {args.n} samples, "
          f"evaluated every {args.test_freq} steps on {args.val_prompts} held-out prompts")  # fmt: skip
    print(report(results, args))
    figures(results, quick=args.quick)
    plot(results, args.png)
    print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps({str(m): v for m, v in results.items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
