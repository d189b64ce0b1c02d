"""Overlap benchmark: asynchronous (``max_staleness`` > 0) against synchronous (``0``) on the same work.

Both runs use the same model, prompts (same seed), group size, token limits and number of steps, each
a real ``tether up`` (embedded Redis, learner under torchrun, rollout servers). From the synchronous
run's phases it derives the ideal speed-up of overlapping generation with training,

    ideal = (T_gen + T_train) / max(T_gen, T_train)

with T_gen the learner's wait for data per step and T_train its compute plus weight-sync time per
step, and prints achieved = samples/s async ÷ sync, efficiency = achieved ÷ ideal, and the final reward
of both (equal samples: same steps × batch). Steps before ``--skip`` are excluded (start-up).

    python bench/overlap.py            # ~4 minutes on 2 CPU cores
    python bench/overlap.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tether.metrics import read_metrics  # noqa: E402


def run_mode(args: argparse.Namespace, *, staleness: int, model: Path, out: Path) -> list[dict]:
    run_id = f"overlap-s{staleness}"
    transport = {"type": args.transport, **({"master_port": 0} if args.transport == "gloo" else {})}
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(out), "seed": 0, "tensorboard": False},
        "model": {"path": str(model)},
        "rollout": {"engine": {"type": "transformers", "max_num_seqs": 128}, "reward": {"type": "demo"},
                    "n": args.n, "max_tokens": args.max_tokens, "num_servers": 1, "prompt_workers": args.batch},
        "learner": {"total_steps": args.steps, "train_batch_size": args.batch, "lr": 1e-3,
                    "data_path": "demo:charclass", "checkpoint_every": 0, "export_hf": False},
        "algorithm": {"max_staleness": staleness},
        "weight_sync": {"transport": transport},
    }  # fmt: skip
    path = out / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    print(f"running max_staleness={staleness} ...", flush=True)
    result = subprocess.run([sys.executable, "-m", "tether", "up", "--config", str(path)], cwd=REPO,
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"tether up failed (max_staleness={staleness}):\n{result.stderr[-3000:]}")
    return [r for r in read_metrics(out / run_id / "metrics.jsonl") if r.get("learner/samples") is not None]


def summarize(rows: list[dict], skip: int) -> dict[str, float]:
    timed = rows[skip:]
    if len(timed) < 2:
        raise SystemExit("too few steps to time; raise --steps")
    wall = timed[-1]["time"] - rows[skip - 1]["time"] if skip else timed[-1]["time"] - timed[0]["time"]
    samples = sum(r["learner/samples"] for r in (timed if skip else timed[1:]))
    mean = lambda key: sum(r.get(key) or 0.0 for r in timed) / len(timed)  # noqa: E731
    last = rows[-3:]
    return {
        "samples_per_s": samples / wall,
        "t_gen": mean("timing/wait_data"),
        "t_train": mean("timing/compute") + mean("timing/weight_sync"),
        "final_reward": sum(r["reward/mean"] for r in last) / len(last),
        "first_reward": rows[0]["reward/mean"],
        "staleness_mean": mean("staleness/mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="steps excluded from timing (start-up)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per learner step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--staleness", type=int, default=1, help="max_staleness of the async run")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--transport", choices=["filesystem", "gloo"], default="gloo")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--out", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.skip, args.batch, args.n, args.max_tokens, args.hidden, args.layers = 6, 2, 4, 4, 8, 64, 2

    from tether.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="tether-overlap-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(out / "model", hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // 32))
        sync = summarize(run_mode(args, staleness=0, model=model, out=out), args.skip)
        asyn = summarize(run_mode(args, staleness=args.staleness, model=model, out=out), args.skip)

    ideal = (sync["t_gen"] + sync["t_train"]) / max(sync["t_gen"], sync["t_train"])
    achieved = asyn["samples_per_s"] / sync["samples_per_s"]
    results = {"sync": sync, "async": asyn, "ideal": ideal, "achieved": achieved, "efficiency": achieved / ideal}
    print(f"\nsteps {args.steps} (timed from step {args.skip + 1}), {args.batch} prompts x {args.n} samples, "
          f"max_tokens {args.max_tokens}, model {args.hidden}x{args.layers}, transport {args.transport}")  # fmt: skip
    print(f"{'mode':<22}{'samples/s':>10}{'T_gen s':>9}{'T_train s':>10}{'staleness':>10}{'reward':>16}")
    for name, r in (("sync (max_staleness 0)", sync), (f"async (max_staleness {args.staleness})", asyn)):
        print(f"{name:<22}{r['samples_per_s']:>10.1f}{r['t_gen']:>9.3f}{r['t_train']:>10.3f}"
              f"{r['staleness_mean']:>10.2f}{r['first_reward']:>8.3f}->{r['final_reward']:.3f}")  # fmt: skip
    print(f"achieved speed-up (async / sync samples/s): {achieved:.2f}")
    print(f"ideal speed-up (T_gen + T_train) / max(T_gen, T_train): {ideal:.2f}")
    print(f"efficiency (achieved / ideal): {achieved / ideal:.2f}   (goal >= 0.85)")
    print(f"final reward async - sync at equal samples: {asyn['final_reward'] - sync['final_reward']:+.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
