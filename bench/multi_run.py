"""One rollout fleet serving several runs (``tether rollout --runs a,b``) against what a user runs today.

Two figures, each over at least 3 repeats, the order alternating where there are two sides:

- ``shares``: two runs with ``rollout.share`` 1 and 3, prompts waiting in both, one fleet process whose
  gate lets one generation run at a time. The figure is the relative error of the share-3 run's part of
  the generated tokens against its configured 0.75 (goal: at most 0.10, issue 36).
- ``throughput``: ``--runs`` runs (2, or 4) of the demo task, each under its own ``tether learner``,
  served either by one fleet process (shared) or by one ``tether rollout`` server each (dedicated, what a
  user runs today). Each dedicated server and each learner has one thread (``OMP_NUM_THREADS=1``); the
  fleet ``--fleet-threads`` (default 1: on a machine whose cores the learners share, more oversubscribe).
  The figure is the aggregate trained samples/s, shared ÷ dedicated, twice: full fine-tuning (each run its
  own copy of the weights: the fleet shares the process and cores, not the batches) and LoRA rank 8 on one
  base (one engine, every run's rows in its batches: issue 36's goal, at least 1.3×).

    python bench/multi_run.py                   # both figures
    python bench/multi_run.py --part shares     # the share split only (about a minute)
    python bench/multi_run.py --part throughput --runs 4 --kinds lora
    python bench/multi_run.py --quick           # a smoke run: fewer steps and groups
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, ordered, report  # noqa: E402
from tether.metrics import read_metrics  # noqa: E402
from tether.redis_server import EmbeddedRedis  # noqa: E402

SHARES = {"share-1": 1.0, "share-3": 3.0}
GROUP = 8  # rollout.n


def write_config(out: Path, model: Path, run_id: str, *, steps: int, lora: bool = False, **rollout: object) -> Path:
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(out / "runs"), "seed": 0, "loggers": ["console"]},
        "model": {"path": str(model), **({"lora": {"rank": 8, "alpha": 16}} if lora else {})},
        "rollout": {"engine": {"type": "transformers", "max_num_seqs": 64}, "reward": {"type": "demo"}, "n": GROUP,
                    "max_tokens": 8, "num_servers": 1, "prompt_workers": 4, **rollout},
        "learner": {"total_steps": steps, "train_batch_size": 8, "lr": 3e-3, "data_path": "demo:charclass",
                    "checkpoint_every": 0, "export_hf": False},
        "algorithm": {"max_staleness": 1},
        "buffer": {"max_trajectory_groups": 10_000},
        "weight_sync": {"transport": {"type": "filesystem"}},
    }  # fmt: skip
    path = out / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(threads: int) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))


def _tether(*args: str, log: Path, threads: int = 1) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "tether", *args], cwd=REPO, env=_env(threads), stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def share_split(out: Path, model: Path, *, groups: int) -> float:
    """The share-3 run's part of the generated tokens once ``groups`` groups of both runs are written."""
    import redis

    from buffer import PromptQueue, RedisKeys, TrajectoryReader
    from buffer.run_config import publish_run_config
    from tether.config import load_config
    from tether.tasks import demo_rows
    from tether.v1 import trajectory_pb2

    with EmbeddedRedis(out / "redis-shares") as url:
        client = redis.Redis.from_url(url)
        for run, share in SHARES.items():
            cfg = load_config(write_config(out, model, run, steps=1, share=share), [])
            publish_run_config(client, RedisKeys(run), cfg.model_dump(mode="json"))
            rows = zip(range(groups * 2), demo_rows(seed=3), strict=False)
            prompts = (
                trajectory_pb2.Prompt(prompt_id=f"p{i}", text=r["prompt"], reward_context={"answer": r["answer"]})
                for i, r in rows
            )
            PromptQueue(client, RedisKeys(run)).feed(prompts, version=0, prompts_per_version=groups * 2,
                                                     max_staleness=0)  # fmt: skip
        fleet_cfg = write_config(out, model, "fleet", steps=1, prompt_workers=1)
        fleet = _tether("rollout", "--config", str(fleet_cfg), "--buffer.redis_url", url, "--runs", ",".join(SHARES),
                        log=out / "fleet-shares.log")  # fmt: skip
        buffer = load_config(None, []).buffer
        readers = {run: TrajectoryReader(client, RedisKeys(run), buffer, consumer="bench") for run in SHARES}
        tokens, done = dict.fromkeys(SHARES, 0), 0
        try:
            deadline = time.monotonic() + 600
            while done < groups and fleet.poll() is None and time.monotonic() < deadline:
                for run, reader in readers.items():
                    for b in reader.read(100, current_version=0, max_staleness=100, block_ms=0):
                        done += 1
                        tokens[run] += sum(t.num_completion_tokens for t in b.group.trajectories)
                time.sleep(0.2)
        finally:
            fleet.send_signal(signal.SIGTERM)
            fleet.wait(timeout=120)
            client.close()
        if done < groups:
            raise SystemExit(f"the fleet wrote {done} of {groups} groups; see {out / 'fleet-shares.log'}")
        return tokens["share-3"] / sum(tokens.values())


def samples_per_s(metrics: Path, skip: int) -> tuple[float, float, int, float]:
    """(start, end, samples, late reward) of a run's timed steps: the learner's own clock, start-up excluded;
    the late reward is the mean ``reward/mean`` of its last 10 steps (the curve each side must keep)."""
    rows = [r for r in read_metrics(metrics) if r.get("reward/mean") is not None]
    if len(rows) <= skip + 1:
        raise SystemExit(f"{metrics}: too few steps to time; raise --steps")
    timed = rows[skip + 1 :]
    late = sum(r["reward/mean"] for r in rows[-10:]) / len(rows[-10:])
    return rows[skip]["time"], timed[-1]["time"], sum(int(r["data/groups"]) * GROUP for r in timed), late


def several_runs(out: Path, model: Path, *, n_runs: int, shared: bool, steps: int, skip: int, tag: str,
                 lora: bool, fleet_threads: int) -> tuple[float, float]:  # fmt: skip
    """Aggregate trained samples/s of ``n_runs`` runs served by one fleet (``shared``) or a server each, and
    their late reward (mean over the runs)."""
    runs = [f"{tag}-{i}" for i in range(n_runs)]
    configs = {run: write_config(out, model, run, steps=steps, lora=lora) for run in runs}
    with EmbeddedRedis(out / f"redis-{tag}") as url:
        common = ["--buffer.redis_url", url]
        if shared:
            # the fleet's gate lets through what the dedicated servers run together (4 prompt workers each)
            servers = [_tether("rollout", "--config", str(configs[runs[0]]), *common, "--runs", ",".join(runs),
                               "--rollout.prompt_workers", str(4 * n_runs), "--exit-when-run-ends",
                               log=out / f"{tag}-fleet.log", threads=fleet_threads)]  # fmt: skip
        else:
            servers = [_tether("rollout", "--config", str(configs[run]), *common, "--exit-when-run-ends",
                               log=out / f"{tag}-{run}-server.log") for run in runs]  # fmt: skip
        learners = [_tether("learner", "--config", str(configs[run]), *common, log=out / f"{run}-learner.log")
                    for run in runs]  # fmt: skip
        try:
            codes = [p.wait(timeout=1200) for p in learners]
            for p in servers:
                p.wait(timeout=120)
        finally:
            for p in (*servers, *learners):
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"a learner failed ({codes}); see {out}")
    spans = [samples_per_s(out / "runs" / run / "metrics.jsonl", skip) for run in runs]
    start, end = min(s[0] for s in spans), max(s[1] for s in spans)
    return sum(s[2] for s in spans) / (end - start), sum(s[3] for s in spans) / len(spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "shares", "throughput"), default="all")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer groups and steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="steps excluded from timing (start-up)")
    parser.add_argument("--groups", type=int, default=80, help="groups written per share measurement")
    parser.add_argument("--runs", type=int, default=2, help="runs of the throughput figure (2 or 4)")
    parser.add_argument("--kinds", default="full,lora", help="throughput figures: full, lora or both")
    parser.add_argument("--fleet-threads", type=int, default=1, help="the shared fleet's OMP_NUM_THREADS")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.groups = 10, 24
    args.repeats = max(3, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = out / "tiny-model"
        from tether.commands.tiny_model import make_tiny_model

        make_tiny_model(model, hidden=64, layers=2, heads=2)
        if args.part in ("all", "shares"):
            errors = []
            for i in range(args.repeats):
                (out / f"shares-{i}").mkdir()
                part = share_split(out / f"shares-{i}", model, groups=args.groups)
                errors.append(abs(part / 0.75 - 1))
                print(f"shares 1:3, repeat {i + 1}: the share-3 run got {part:.3f} of the tokens", flush=True)
            report(figure("multi_run/share_error", errors, goal=0.10, direction="max",
                          baseline="the configured split (0.75 of the tokens to the run of share 3)"),
                   quick=args.quick)  # fmt: skip
        if args.part in ("all", "throughput"):
            for kind in args.kinds.split(","):
                lora = kind == "lora"
                ratios = []
                for i in range(args.repeats):
                    rate, late = {}, {}
                    for mode in ordered(("dedicated", "shared"), i):
                        folder = out / f"{kind}-{mode}-{i}"
                        folder.mkdir()
                        rate[mode], late[mode] = several_runs(folder, model, n_runs=args.runs, steps=args.steps,
                                                              shared=mode == "shared", skip=args.skip,
                                                              tag=f"{kind}-{mode}-{i}", lora=lora,
                                                              fleet_threads=args.fleet_threads)  # fmt: skip
                        print(f"{kind}, repeat {i + 1}: {mode}: {rate[mode]:.1f} samples/s ({args.runs} runs "
                              f"together), reward over the last 10 steps {late[mode]:.3f}", flush=True)  # fmt: skip
                    ratios.append(rate["shared"] / rate["dedicated"])
                note = (
                    "LoRA rank 8 on one base: the fleet loads it once and batches every run's rows"
                    if lora
                    else "full fine-tuning: each run its own weights, the fleet shares process and cores"
                )
                report(figure(f"multi_run/{kind}_{args.runs}_runs_shared_vs_dedicated", ratios,
                              goal=1.3 if lora else None, direction="min", note=note,
                              baseline=f"a rollout server per run (tether rollout) on one thread each; the fleet "
                                       f"on {args.fleet_threads}"),
                       quick=args.quick)  # fmt: skip


if __name__ == "__main__":
    main()
