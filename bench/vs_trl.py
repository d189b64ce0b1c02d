"""tether against TRL's ``GRPOTrainer`` on the same job, side by side on one machine.

The first thing a skeptical user does is run the same job in TRL. This does it for them: the same tiny
model (made locally), the same ``charclass`` prompts (``tether/tasks.py``, same seed, same order) and
reward, the same knobs — 8 prompts × 8 samples per step, constant lr 3e-3, token-mean loss (TRL
``loss_type="dapo"``), clip 0.2/0.28, no KL, no entropy bonus, temperature 1, grad clip 1.0, both
sides stopping only at EOS or the token limit — at two sizes (64 wide × 2 layers with 8 completion
tokens; 256 wide × 4 layers with 64), tether asynchronous (``max_staleness: 1``) and synchronous (``0``).
Every trial is a fresh process (TRL in a child of this script, tether as ``tether up``); the order of
the three rotates with the seed so no system always runs first on a warm or cold machine. TRL runs with
its defaults (all cores to its one process); tether with its own (``tether/resources.py``). Precision is
the same on both sides: ``--precision bf16`` (the default) is TRL's own default — ``bf16=True``, which
autocasts generation and training on CPU too — against tether's ``learner.param_dtype: bfloat16`` (FSDP2
mixed precision, float32 master weights); ``fp32`` turns both off. tether's engine samples in float32 either
way (bf16 weights decoded no faster on a 2-vCPU AVX512-BF16 VM, autocast 13 % slower).

Timing excludes start-up: s/step is the wall time from the end of step ``--skip`` to the end of the last
step, over the steps in between. Samples/s = 64 / s/step. Each tether trial is paired with the TRL
trial of the same seed for the ratio, printed as median (min–max) over seeds. Reward per step is the
mean over seeds of each step's mean reward; both learn the same task, so the curves should overlap.

    python bench/vs_trl.py            # 3 seeds x 2 sizes x 3 systems x 20 steps: ~15 minutes on 2 cores
    python bench/vs_trl.py --quick    # 1 seed, the small size, 6 steps: a smoke run (~1 minute)

Needs TRL (``pip install -e .[bench]``). Run it on a quiet machine: where other work shares the cores,
multi-threaded torch on either side slows down by large and erratic factors (TRL took 0.6–4.2 s/step
with two threads and 0.12–0.23 s with one, at the small size on a busy 2-core machine).
``OMP_NUM_THREADS=1`` pins both sides to one thread per process there: a fair comparison, but not the
default one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, tether_up  # noqa: E402
from bench.common import report as report_figure  # noqa: E402

PROMPTS, SAMPLES, LR = 8, 8, 3e-3
SIZES = {
    "64x2": {"hidden": 64, "layers": 2, "heads": 2, "tokens": 8},
    "256x4": {"hidden": 256, "layers": 4, "heads": 8, "tokens": 64},
}
SYSTEMS = ("trl", "async", "sync")
PARAM_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}  # tether's learner.param_dtype for --precision


def tether_trial(*, model: Path, tokens: int, staleness: int, seed: int, steps: int, out: Path, precision: str) -> dict:
    """One ``tether up`` run; per-step end times and mean rewards from its metrics."""
    from tether.metrics import read_metrics

    run_id = f"s{staleness}-seed{seed}-{model.name}"
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(out), "seed": seed, "loggers": ["console"]},
        "model": {"path": str(model)},
        "rollout": {"engine": {"type": "transformers", "max_num_seqs": 64}, "reward": {"type": "demo"},
                    "n": SAMPLES, "temperature": 1.0, "max_tokens": tokens, "max_prompt_len": 64, "num_servers": 1},
        "learner": {"total_steps": steps, "train_batch_size": PROMPTS, "lr": LR, "lr_warmup_steps": 0,
                    "lr_scheduler": "constant", "grad_clip": 1.0, "data_path": "demo:charclass",
                    "checkpoint_every": 0, "export_hf": False, "param_dtype": PARAM_DTYPE[precision]},
        "algorithm": {"max_staleness": staleness, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.2,
                      "clip_ratio_high": 0.28, "use_kl_loss": False, "entropy_coeff": 0.0},
        "weight_sync": {"transport": {"type": "filesystem"}, "sync_every": 1},
    }  # fmt: skip
    run_dir = tether_up(cfg, out=out, run_id=run_id)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("learner/samples") is not None]
    return {
        "end_times": [r["time"] for r in rows],
        "rewards": [r["reward/mean"] for r in rows],
        "length": statistics.fmean(r["response/length_mean"] for r in rows),
    }


def trl_trial(*, model: Path, tokens: int, seed: int, steps: int, out: Path, precision: str) -> dict:
    """One TRL run in a fresh child process (``--trl-child``)."""
    spec = json.dumps({"model": str(model), "tokens": tokens, "seed": seed, "steps": steps, "out": str(out),
                       "bf16": precision == "bf16"})  # fmt: skip
    result = subprocess.run([sys.executable, __file__, "--trl-child", spec], cwd=REPO, capture_output=True,
                            text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"TRL run failed (seed {seed}, {model.name}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def grpo_config(*, out: Path, seed: int, steps: int, prompts: int, samples: int, tokens: int, lr: float, bf16: bool):  # type: ignore[no-untyped-def]
    """TRL's ``GRPOConfig`` with tether's defaults where the concept is the same: ``prompts`` x ``samples`` a step
    in one optimizer step, constant ``lr``, token-mean loss (``dapo``), clip 0.2/0.28, no KL, no weight decay,
    grad clip 1.0, temperature 1, the prompts in order; ``bf16`` is TRL's autocast (its default, on CPU too)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=bf16,
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=prompts * samples,
        gradient_accumulation_steps=1,
        num_generations=samples,
        max_completion_length=tokens,
        temperature=1.0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        shuffle_dataset=False,  # tether streams the task in order; keep the same prompts per step
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def trl_child(spec: dict) -> None:
    """Runs in its own process: TRL GRPOTrainer on the same prompts, reward and knobs; prints JSON."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from tether.tasks import demo_reward, demo_rows

    steps, seed = spec["steps"], spec["seed"]
    rows = list(itertools.islice(demo_rows("charclass", seed=seed), PROMPTS * steps))
    dataset = Dataset.from_list(rows)

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [demo_reward(c, {"answer": a}) for c, a in zip(completions, answer, strict=True)]

    end_times: list[float] = []
    rewards: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            end_times.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                lengths.append(float(logs.get("completions/mean_length", 0.0)))

    config = grpo_config(out=Path(spec["out"]) / f"trl-seed{seed}", seed=seed, steps=steps, prompts=PROMPTS,
                         samples=SAMPLES, tokens=spec["tokens"], lr=LR, bf16=spec["bf16"])  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(spec["model"]),
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[Clock()],
    )
    trainer.train()
    print(json.dumps({"end_times": end_times, "rewards": rewards, "length": statistics.fmean(lengths or [0.0])}))


def seconds_per_step(end_times: list[float], skip: int) -> float:
    if len(end_times) <= skip + 1:
        raise SystemExit(f"too few steps to time ({len(end_times)}); raise --steps or lower --skip")
    return (end_times[-1] - end_times[skip - 1]) / (len(end_times) - skip)


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def report(size: str, trials: dict[str, list[dict]], skip: int) -> dict:
    sps = {s: [seconds_per_step(t["end_times"], skip) for t in trials[s]] for s in SYSTEMS}
    out: dict = {"s_per_step": sps}
    print(f"\n== {size}, {SIZES[size]['tokens']} tokens, {PROMPTS}x{SAMPLES} samples/step, "
          f"{len(sps['trl'])} seed(s), timed after step {skip}")  # fmt: skip
    print(f"{'system':<26}{'s/step':>26}{'samples/s':>26}{'samples/s vs TRL':>26}{'mean length':>13}")
    for system in SYSTEMS:
        name = {"trl": "TRL GRPOTrainer", "async": "tether max_staleness 1", "sync": "tether max_staleness 0"}[system]
        ratios = [trl / s for trl, s in zip(sps["trl"], sps[system], strict=True)]  # samples/s ratio
        out[f"ratio_{system}"] = ratios
        length = statistics.fmean(t["length"] for t in trials[system])
        print(f"{name:<26}{spread(sps[system]):>26}{spread([PROMPTS * SAMPLES / s for s in sps[system]], '{:.1f}'):>26}"
              f"{spread(ratios, '{:.2f}x'):>26}{length:>13.1f}")  # fmt: skip
    print("reward per step (mean over seeds):")
    for system in SYSTEMS:
        curves = [t["rewards"] for t in trials[system]]
        n = min(len(c) for c in curves)
        mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
        out[f"reward_{system}"] = mean
        print(f"  {system:<6}" + " ".join(f"{r:.2f}" for r in mean))
    # Per seed, because a mean over 3 seeds hides a collapsed run (one prompt class locked onto another's
    # characters happens to about a third of runs at this lr in every system; docs/STALENESS.md).
    print("reward over the last 5 steps, per seed:")
    for system in SYSTEMS:
        finals = [statistics.fmean(t["rewards"][-5:]) for t in trials[system]]
        out[f"final_reward_{system}"] = finals
        print(f"  {system:<6}" + " ".join(f"{r:.2f}" for r in finals) + f"   median {statistics.median(finals):.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, the small size, 6 steps")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="steps excluded from timing (start-up)")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    parser.add_argument("--precision", choices=sorted(PARAM_DTYPE), default="bf16",
                        help="both sides: TRL bf16, tether learner.param_dtype (default: TRL's)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--out", type=Path, help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(json.loads(args.trl_child))
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("bench/vs_trl.py needs TRL: pip install -e .[bench]") from None
    if args.quick:
        args.seeds, args.steps, args.skip, args.sizes = 1, 6, 2, ["64x2"]

    from tether.commands.tiny_model import make_tiny_model

    results = {}
    with tempfile.TemporaryDirectory(prefix="tether-vs-trl-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for size in args.sizes:
            sz = SIZES[size]
            model = make_tiny_model(out / f"model-{size}", hidden=sz["hidden"], layers=sz["layers"], heads=sz["heads"])
            trials: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
            for seed in range(args.seeds):
                k = seed % len(SYSTEMS)  # rotate the order: each system runs first once every 3 seeds
                for system in SYSTEMS[k:] + SYSTEMS[:k]:
                    print(f"{size} seed {seed}: {system} ...", flush=True)
                    common = {"model": model, "tokens": sz["tokens"], "seed": seed, "steps": args.steps, "out": out,
                              "precision": args.precision}  # fmt: skip
                    if system == "trl":
                        trials[system].append(trl_trial(**common))
                    else:
                        trials[system].append(tether_trial(staleness=int(system == "async"), **common))
            results[size] = report(size, trials, args.skip)
            for system, goal in (("async", 1.5), ("sync", 1.0)):  # the goals: samples/s vs TRL's
                fig = figure(
                    f"vs_trl/{size}_{system}_samples_per_s" + ("" if args.precision == "bf16" else "_fp32"),
                    results[size][f"ratio_{system}"],
                    goal=goal,
                    direction="min",
                    baseline=f"TRL GRPOTrainer on the same job, same seed ({size}, {args.precision} on both sides)",
                )
                report_figure(fig, quick=args.quick)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
