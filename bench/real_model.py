"""The real model's step (Gemma 3 270M, ``configs/gemma-addition.yaml``'s job), and what sharing a group's
prompt is worth on it, in the same run.

    python bench/real_model.py [--quick] [--repeats N]

The job: 4 few-shot addition prompts (``demo:fewshot_addition``, ~80 tokens with ``<bos>``) x 8 samples of
up to 10 tokens. Two figures, each side alternating first from repeat to repeat:

* ``real_model/learner_step_vs_copies``: one learner step (1 gloo rank, float32, the config's knobs) with
  ``learner.share_prompts`` (each prompt once per micro-batch, completions attending to it) over the same
  step with one copy of the prompt per sample — what every packed learner does (verl's remove-padding, TRL).
  Same groups, same model; the log-probs are equal (``tests/unit/test_shared_prompts.py``).
* ``real_model/engine_vs_generate``: the transformers engine's tokens/s on the job's rollout (4 requests of
  ``n`` 8, prefilled once per prompt, rows continuously batched) over transformers' ``generate`` on the same
  32 rows in one batch (what TRL's ``GRPOTrainer`` runs without vLLM: the prompt repeated
  ``num_generations`` times), both at temperature 1 for 10 new tokens, no stop, in float32 on the same threads.

Needs the real model (``make real-model``). Nothing else may run meanwhile: on 2 cores a background job skews
a ratio by 3x or more.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gemma-addition.yaml"
PROMPTS, N, NEW_TOKENS = 4, 8, 10


def _config(workdir: Path, **learner: object):  # type: ignore[no-untyped-def]
    import yaml

    from tether.config.loader import load_config
    from tether.model_path import with_model_folder

    raw = yaml.safe_load(CONFIG.read_text())
    raw["run"].update(output_dir=str(workdir / "runs"), run_id="bench")
    raw["learner"].update(device="cpu", **learner)
    path = workdir / f"config-{len(learner)}-{sorted(learner.items())}.yaml".replace(" ", "")
    path.write_text(yaml.safe_dump(raw))
    return with_model_folder(load_config(path))


def _prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from tether.prompts import encode_prompt
    from tether.tasks import demo_rows

    rows = demo_rows("fewshot_addition", seed=0)
    return [encode_prompt(tokenizer, next(rows)["prompt"]) for _ in range(PROMPTS)]


def _groups(prompts: list[list[int]], seed: int):  # type: ignore[no-untyped-def]
    import numpy as np

    from tether.trajectory import GroupData, TrajectoryData

    rng = np.random.default_rng(seed)
    groups = []
    for g, prompt in enumerate(prompts):
        trajs = []
        for k in range(N):
            n = int(rng.integers(4, NEW_TOKENS + 1))
            trajs.append(TrajectoryData(
                prompt_token_ids=np.asarray(prompt, dtype=np.int32),
                completion_token_ids=rng.integers(0, 256_000, n, dtype=np.int32),
                behavior_logprobs=(-rng.uniform(0.1, 3.0, n)).astype(np.float32),
                policy_versions=np.zeros(n, dtype=np.int32),
                loss_mask=np.ones(n, dtype=np.uint8),
                reward=float(k % 3 == 0),
                id=f"g{g}-t{k}",
                group_id=f"g{g}",
            ))  # fmt: skip
        groups.append(GroupData(group_id=f"g{g}", trajectories=trajs))
    return groups


def bench_learner(workdir: Path, repeats: int, steps: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from learner.parallelize import load_model, parallelize
    from learner.trainer import Trainer
    from tether.redis_server import free_port

    cfg = _config(workdir)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    try:
        model = parallelize(load_model(cfg, device), cfg, device)
        trainer = Trainer(cfg, model, device=device, ref_model=None)
        assert trainer.share_prompts, "the default learner shares prompts on this job"
        groups = _groups(_prompts(AutoTokenizer.from_pretrained(cfg.model.path)), seed=0)

        def block(share: bool) -> float:
            trainer.share_prompts = share
            times = []
            for k in range(steps):
                start = time.perf_counter()
                trainer.train_step(groups, version=k, step=k)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        block(True)  # warm-up
        ratios = []
        for r in range(repeats):
            t = {side: block(side) for side in ordered([True, False], r)}
            print(f"  learner repeat {r}: shared {t[True]:.2f} s/step, a copy per sample {t[False]:.2f} s/step")
            ratios.append(t[False] / t[True])
        return ratios
    finally:
        dist.destroy_process_group()


def bench_engine(workdir: Path, repeats: int) -> list[float]:
    import torch

    from rollout_server.engines import SamplingSpec, build_engine

    cfg = _config(workdir)
    engine = build_engine(cfg)

    async def engine_side() -> float:
        spec = SamplingSpec(n=N, max_tokens=NEW_TOKENS, temperature=1.0)
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, spec) for p in prompts))
        return sum(len(s.token_ids) for samples in outs for s in samples) / (time.perf_counter() - start)

    def generate_side() -> float:
        rows = [p for p in prompts for _ in range(N)]
        width = max(map(len, rows))
        pad = engine.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        start = time.perf_counter()
        with torch.inference_mode():
            out = engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                        top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                        pad_token_id=pad)  # fmt: skip
        return (out.shape[1] - width) * len(rows) / (time.perf_counter() - start)

    async def run() -> list[float]:
        await engine.start()
        prompts.extend(_prompts(engine.tokenizer))  # the engine loads its tokenizer at start
        try:
            sides = {"engine": engine_side, "generate": lambda: asyncio.to_thread(generate_side)}
            await sides["engine"]()
            await sides["generate"]()  # warm-up both
            ratios = []
            for r in range(repeats):
                rate = {}
                for side in ordered(list(sides), r):
                    rate[side] = await sides[side]()
                print(f"  engine repeat {r}: engine {rate['engine']:.1f} tok/s, generate {rate['generate']:.1f} tok/s")
                ratios.append(rate["engine"] / rate["generate"])
            return ratios
        finally:
            await engine.shutdown()

    prompts: list[list[int]] = []
    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one step per block (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every block (default 3; >= 3)")
    args = parser.parse_args(argv)
    repeats = max(3, args.repeats or 3)
    what = "Gemma 3 270M, 4 few-shot prompts x 8 samples x <= 10 tokens, float32, 2 CPU threads"
    with tempfile.TemporaryDirectory(prefix="tether-bench-real-") as tmp:
        engine = bench_engine(Path(tmp), repeats)
        learner = bench_learner(Path(tmp), repeats, steps=1 if args.quick else 2)
    report(figure("real_model/learner_step_vs_copies", learner, goal=None, direction="min",
                  baseline="the same learner step with one copy of the prompt per sample (learner.share_prompts "
                           "false; packed rows as verl and TRL pack them)", note=what), quick=args.quick)  # fmt: skip
    report(figure("real_model/engine_vs_generate", engine, goal=1.2, direction="min",
                  baseline="transformers' generate on the 32 rows in one batch (TRL GRPOTrainer without vLLM), "
                           "10 new tokens each", note=what), quick=args.quick)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
