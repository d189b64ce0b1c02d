"""The real-model job side by side with TRL's ``GRPOTrainer``: does tether learn per step as TRL does, and how
fast does each train?

    python bench/real_model_trl.py [--seeds 3] [--steps 20] [--quick]

The job is ``configs/gemma-addition.yaml``'s (Gemma 3 270M base, few-shot single-digit addition answered in
``\\boxed{}``, the ``math`` rule): 4 prompts × 8 samples a step, constant lr 2e-6, token-mean loss (TRL
``loss_type="dapo"``), clip 0.2/0.28, no KL, no entropy bonus, grad clip 1.0, temperature 1, up to 10
completion tokens, float32 on both sides, the same prompts in the same order (``demo_rows``, the run's seed).
One knob differs from the demo: **no stop string on either side** (TRL's ``GRPOTrainer`` stops only at EOS
without vLLM), so every completion runs its 10 tokens. tether runs with its defaults (``tether up``, the
transformers engine) asynchronous (``max_staleness: 1``, the demo's) and synchronous (``0``); TRL with its own
(one process, ``generate``, on-policy). Each seed runs all three, the order rotating from seed to seed.

Both evaluate the same held-out prompts (the first 32 of ``demo_rows(..., split="val")``, pairs never trained
on) before training and every 5 steps: 4 samples each at T = 1 (no top-k/top-p), mean reward = ``val/mean@k``
— tether through its own evaluation, TRL through ``generate`` in a callback. Printed: the held-out curve of
each, per seed and their mean, and the reward per step; figures, for each of tether's two modes: its held-out
accuracy at the last step over TRL's, and its samples/s (the median step time over steps with no evaluation
before them) over TRL's.

Needs the real model (``make real-model``) and TRL (``pip install -e .[bench]``); ~45 minutes a seed on 2
cores (TRL ~30). Nothing else may run meanwhile.
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

from bench.common import figure, ordered, report, tether_up  # noqa: E402
from bench.vs_trl import grpo_config  # noqa: E402

CONFIG = REPO / "configs" / "gemma-addition.yaml"
PROMPTS, N, LR, TOKENS, EVAL_EVERY, VAL_PROMPTS, VAL_N = 4, 8, 2e-6, 10, 5, 32, 4
SIDES = {"async": 1, "sync": 0, "trl": 0}
"""Each side and its ``algorithm.max_staleness`` (TRL is on-policy)."""


def tether_trial(*, seed: int, steps: int, out: Path, staleness: int) -> dict:
    """``tether up`` on the job; held-out curve, per-step reward and step end times from its metrics."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["algorithm"]["max_staleness"] = staleness
    run_id = f"tether-s{staleness}-seed{seed}"
    cfg["run"].update(run_id=run_id, seed=seed, output_dir=str(out), loggers=["console"])
    cfg["rollout"]["stop"] = []
    cfg["learner"].update(total_steps=steps, test_freq=EVAL_EVERY, val_n=VAL_N, val_max_prompts=VAL_PROMPTS,
                          lr=LR, train_batch_size=PROMPTS)  # fmt: skip
    cfg["rollout"].update(n=N, max_tokens=TOKENS, temperature=1.0)
    run = tether_up(cfg, out=out, run_id=run_id)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {int(r["step"]): float(r["val/mean@k"]) for r in rows if "val/mean@k" in r}
    trained = sorted((r for r in rows if "reward/mean" in r), key=lambda r: int(r["step"]))
    return {"curve": curve, "end_times": [float(r["time"]) for r in trained],
            "rewards": [float(r["reward/mean"]) for r in trained]}  # fmt: skip


def trl_trial(*, seed: int, steps: int, out: Path, staleness: int = 0) -> dict:
    """TRL in a fresh child process (``--trl-child``)."""
    spec = json.dumps({"seed": seed, "steps": steps, "out": str(out)})
    result = subprocess.run([sys.executable, __file__, "--trl-child", spec], cwd=REPO, capture_output=True,
                            text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"TRL run failed (seed {seed}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _model_folder() -> str:
    from tether.config.loader import load_config
    from tether.model_path import with_model_folder

    return with_model_folder(load_config(CONFIG)).model.path


def trl_child(spec: dict) -> None:
    """Runs in its own process: TRL GRPOTrainer on the job with held-out evaluation; prints JSON."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from tether.scorers import math_reward
    from tether.tasks import demo_rows

    steps, seed = spec["steps"], spec["seed"]
    folder = _model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    train = list(itertools.islice(demo_rows("fewshot_addition", seed=seed), PROMPTS * steps))
    val = list(itertools.islice(demo_rows("fewshot_addition", seed=seed, split="val"), VAL_PROMPTS))

    def score(completion: str, answer: str) -> float:
        return float(math_reward(completion, answer, boxed_only=True)[0])

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [score(c, a) for c, a in zip(completions, answer, strict=True)]

    def held_out(model) -> float:  # type: ignore[no-untyped-def]
        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        batch = tokenizer([r["prompt"] for r in val], return_tensors="pt", padding=True)  # <bos> as tether's
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=TOKENS,
                                 num_return_sequences=VAL_N, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        model.train(was_training)
        return statistics.fmean(score(t, val[i // VAL_N]["answer"]) for i, t in enumerate(texts))

    end_times: list[float] = []
    rewards: list[float] = []
    curve: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            curve[0] = held_out(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            end_times.append(time.time())
            if state.global_step % EVAL_EVERY == 0:
                curve[state.global_step] = held_out(model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    # float32 (no autocast), as tether's learner and engine on CPU
    config = grpo_config(out=Path(spec["out"]) / f"trl-seed{seed}", seed=seed, steps=steps, prompts=PROMPTS,
                         samples=N, tokens=TOKENS, lr=LR, bf16=False)  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        processing_class=tokenizer,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(train),
        callbacks=[Clock()],
    )
    trainer.train()
    print(json.dumps({"curve": curve, "end_times": end_times, "rewards": rewards}))


def step_s(end_times: list[float]) -> float:
    """The median time of a step with no evaluation before it (an evaluation runs after every 5th step)."""
    gaps = [b - a for i, (a, b) in enumerate(itertools.pairwise(end_times), start=1) if i % EVAL_EVERY != 0]
    return statistics.median(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="1 seed, 5 steps (a smoke run, not a measurement)")
    p.add_argument("--trl-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        trl_child(json.loads(args.trl_child))
        return
    seeds, steps = (1, EVAL_EVERY) if args.quick else (args.seeds, args.steps)
    trials: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="tether-real-trl-") as tmp:
        for seed in range(seeds):
            for side in ordered(list(SIDES), seed):
                started = time.monotonic()
                run = trl_trial if side == "trl" else tether_trial
                trials[side].append(run(seed=seed, steps=steps, out=Path(tmp), staleness=SIDES[side]))
                curve = {int(k): v for k, v in trials[side][-1]["curve"].items()}
                trials[side][-1]["curve"] = curve
                print(f"seed {seed} {side}: held-out {' '.join(f'{s}:{v:.2f}' for s, v in sorted(curve.items()))}"
                      f" ({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip

    evals = sorted(set.intersection(*(set(t["curve"]) for ts in trials.values() for t in ts)))
    print("\nheld-out val/mean@k (mean over seeds, min-max) at steps " + " ".join(map(str, evals)))
    for side, ts in trials.items():
        cells = []
        for s in evals:
            xs = [t["curve"][s] for t in ts]
            cells.append(f"{statistics.fmean(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
        print(f"  {side:7s} " + " | ".join(cells))
    print("reward per step (mean over seeds)")
    for side, ts in trials.items():
        per_step = zip(*(t["rewards"] for t in ts), strict=False)  # TRL logs one reward a step, tether too
        print(f"  {side:7s} " + " ".join(f"{statistics.fmean(r):.2f}" for r in per_step))
    for side, ts in trials.items():
        times = ", ".join(f"{step_s(t['end_times']):.1f}" for t in ts)
        print(f"  {side:7s} s/step (no evaluation before it): {times}")
    last = evals[-1]
    note = "" if seeds >= 3 else f"{seeds} seed(s): not the 3-repeat figure"
    for side, goal in (("async", 2.0), ("sync", 1.2)):
        pairs = list(zip(trials[side], trials["trl"], strict=True))
        report(figure(f"real_model_trl/{side}_heldout_step{last}_vs_trl",
                      [a["curve"][last] / max(b["curve"][last], 1e-9) for a, b in pairs], goal=None,
                      direction="min", note=note,
                      baseline=f"TRL GRPOTrainer's held-out mean@4 at step {last}, same seed, job and knobs"),
               quick=args.quick)  # fmt: skip
        report(figure(f"real_model_trl/{side}_samples_per_s_vs_trl",
                      [step_s(b["end_times"]) / step_s(a["end_times"]) for a, b in pairs], goal=goal,
                      direction="min", note=note,
                      baseline="TRL GRPOTrainer's samples/s on the same job (float32, generate, on-policy), same seed"),
               quick=args.quick)  # fmt: skip


if __name__ == "__main__":
    main()
