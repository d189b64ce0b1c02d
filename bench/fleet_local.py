"""Separate processes on one box against ``tether up``: the same run, started by hand, at the same speed?

``docs/FLEETS.md``'s bare-metal commands start Redis, ``tether learner`` and ``tether rollout`` as separate
processes. On one machine those used to run at a fraction of ``tether up``'s speed (each process took
every core: 1–2 s per demo step against ~0.1 s), because only ``tether up`` split the cores between its
children. This benchmark runs the same config both ways, alternating (up, separate, separate, up, ...)
so a busy machine's drift falls on both sides, and prints samples/s of each run and the ratio
separate ÷ up of the medians. Steps before ``--skip`` (start-up, first weight sync) are not timed; the
rate is trained samples over the learner's own step clock, so process start-up is not counted either.

    python bench/fleet_local.py              # 3 repeats of 40 steps each way
    python bench/fleet_local.py --quick      # 3 repeats of 15 steps
    python bench/fleet_local.py --all-cores  # also separate processes each on every core (the old way)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, report  # noqa: E402
from tether.metrics import read_metrics  # noqa: E402
from tether.redis_server import EmbeddedRedis  # noqa: E402


def write_config(args: argparse.Namespace, *, run_id: str, model: Path, out: Path) -> Path:
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(out), "seed": 0, "loggers": ["console"]},
        "model": {"path": str(model)},
        "rollout": {"engine": {"type": "transformers", "max_num_seqs": 64}, "reward": {"type": "demo"}, "n": 8,
                    "max_tokens": 8, "num_servers": 1, "prompt_workers": 4},
        "learner": {"total_steps": args.steps, "train_batch_size": 8, "lr": 3e-3, "data_path": "demo:charclass",
                    "checkpoint_every": 0, "export_hf": False},
        "algorithm": {"max_staleness": 1},
        "weight_sync": {"transport": {"type": "filesystem"}},
    }  # fmt: skip
    for old in (f"{run_id}", f"{run_id}-redis", f"{run_id}-logs"):  # an earlier invocation's: start over
        shutil.rmtree(out / old, ignore_errors=True)
    path = out / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(all_cores: bool = False) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)  # measure what a person gets without setting it
    if all_cores:  # what separate processes did before they split the cores: each took all of them
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    return env


def run_up(config: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tether", "up", "--config", str(config)], cwd=REPO, env=_env(),
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"tether up failed:\n{result.stdout[-3000:]}")


def run_separate(config: Path, *, run_id: str, out: Path, all_cores: bool = False) -> None:
    """Redis, the learner and one rollout server as three processes, as docs/FLEETS.md starts them."""
    with EmbeddedRedis(out / f"{run_id}-redis") as url:
        common = ["--config", str(config), "--run.run_id", run_id, "--buffer.redis_url", url]
        logs = out / f"{run_id}-logs"
        logs.mkdir(exist_ok=True)
        with (logs / "rollout.out").open("wb") as r_out, (logs / "learner.out").open("wb") as l_out:
            env = _env(all_cores)
            server = subprocess.Popen([sys.executable, "-m", "tether", "rollout", *common, "--exit-when-run-ends"],
                                      cwd=REPO, env=env, stdout=r_out, stderr=subprocess.STDOUT)  # fmt: skip
            try:
                code = subprocess.run([sys.executable, "-m", "tether", "learner", *common], cwd=REPO, env=env,
                                      stdout=l_out, stderr=subprocess.STDOUT).returncode  # fmt: skip
                server.wait(timeout=120)  # it exits by itself once the learner has published the run's end
            finally:
                if server.poll() is None:
                    server.terminate()
                    server.wait(timeout=60)
        if code != 0:
            raise SystemExit(f"tether learner failed:\n{(logs / 'learner.out').read_text()[-3000:]}")


def samples_per_s(metrics: Path, skip: int) -> float:
    rows = [r for r in read_metrics(metrics) if r.get("reward/mean") is not None]
    if len(rows) <= skip + 1:
        raise SystemExit("too few steps to time; raise --steps")
    timed = rows[skip + 1 :]
    wall = timed[-1]["time"] - rows[skip]["time"]
    return sum(r["data/groups"] * 8 for r in timed) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="15 steps per run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=3, help="steps excluded from timing (start-up)")
    parser.add_argument("--repeats", type=int, default=3, help="runs each way (at least 3), alternating")
    parser.add_argument("--all-cores", action="store_true", help="also time separate processes on every core each")
    parser.add_argument("--out", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.steps = 15
    args.repeats = max(3, args.repeats)

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = out / "tiny-model"
        if not (model / "config.json").exists():
            from tether.commands.tiny_model import make_tiny_model

            make_tiny_model(model, hidden=64, layers=2, heads=2)
        modes = ("up", "separate", "all-cores") if args.all_cores else ("up", "separate")
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for i in range(args.repeats):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                run_id = f"fleet-{mode}-{i}"
                config = write_config(args, run_id=run_id, model=model, out=out)
                print(f"repeat {i + 1}/{args.repeats}: {mode} ...", flush=True)
                if mode == "up":
                    run_up(config)
                else:
                    run_separate(config, run_id=run_id, out=out, all_cores=mode == "all-cores")
                rates[mode].append(samples_per_s(out / run_id / "metrics.jsonl", args.skip))
                print(f"  {mode}: {rates[mode][-1]:.1f} samples/s", flush=True)
        up, sep = statistics.median(rates["up"]), statistics.median(rates["separate"])
        print(f"tether up:           {' '.join(f'{r:.1f}' for r in rates['up'])} samples/s (median {up:.1f})")
        print(f"separate processes:  {' '.join(f'{r:.1f}' for r in rates['separate'])} samples/s (median {sep:.1f})")
        if args.all_cores:
            old = statistics.median(rates["all-cores"])
            print(f"all cores each:      {' '.join(f'{r:.1f}' for r in rates['all-cores'])} samples/s "
                  f"(median {old:.1f}; all-cores/up {old / up:.2f}x)")  # fmt: skip
        print(f"separate/up samples/s ratio: {sep / up:.2f}x")
        # Per repeat: separate ÷ up of the same repeat (the two ran back to back).
        pairs = zip(rates["separate"], rates["up"], strict=True)
        baseline = "tether up on the same config, same repeat"
        fig = figure("fleet_local/separate_vs_up_samples_per_s", [s / u for s, u in pairs], goal=0.9,
                     direction="min", baseline=baseline)  # fmt: skip
        report(fig, quick=args.quick)


if __name__ == "__main__":
    main()
