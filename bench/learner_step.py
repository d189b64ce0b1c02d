"""The learner's fixed cost per step at the demo size, and what each lever cut from it, in the same run.

    python bench/learner_step.py [--quick] [--repeats N]

One learner rank (gloo, FSDP2 on a one-rank mesh — what a one-rank learner with ``learner.cpu_offload`` runs;
without it one rank now trains the plain module, see ``learner.parallelize``) trains the demo model
(64 wide × 2 layers, ``configs/demo.yaml``'s knobs: 8 prompts × 8 samples, 8 completion tokens) on fixed
synthetic groups and publishes every step to one standalone receiver process over the demo's
filesystem transport (snapshot + Prepare/Commit, the receiver loading the snapshot). Levers, each
switched off alone against all on, in blocks whose order alternates from repeat to repeat:

* ``background``: publication off the critical path (``publish(..., background=True)``, what the learner
  does with ``max_staleness`` ≥ 1) — off: the synchronous publish a ``max_staleness: 0`` run makes;
* ``fused_adamw``: one fused AdamW kernel — off: the per-tensor loop torch picks for CPU DTensors;
* ``local_adamw``: AdamW's kernels on the local shards (:class:`learner.optim.LocalAdamW`) — off: the same
  kernels through DTensor dispatch;
* ``local_shard``: the sender reads a one-rank shard as it is — off: an all-gather per parameter;
* ``local_clip``: gradient clipping on the local tensors of the one-rank mesh — off: ``clip_grad_norm_``
  on the DTensors (DTensor dispatch and one-rank reductions).

The step's other cuts (NumPy-built micro-batches, one host sync for the metrics, no group broadcast on
one rank) have no switch: ``tests/unit/test_trainer_lean_step.py`` keeps the code they replaced as its
bit-identity reference, and they were measured by swapping that code back in step by step (issue 23).

Figures (seconds of the baseline over seconds with every lever on; no goal, they say what a lever is
worth): ``learner_step/step_vs_all_off`` (the whole step: train + what publication leaves on the critical
path), ``learner_step/critical_publish_vs_<lever off>``, ``learner_step/optimizer_vs_loop``,
``learner_step/optimizer_vs_local_adamw_off`` and ``learner_step/train_vs_<lever>_off`` for
``local_clip`` and ``local_adamw`` (the training part of the step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report
from bench.demo_rank import DemoRank

LEVERS = ("background", "fused_adamw", "local_adamw", "local_shard", "local_clip")


class Learner(DemoRank):
    """The demo learner's step, with each lever switchable between blocks."""

    def __init__(self, workdir: Path) -> None:
        from learner import trainer as trainer_module
        from learner.optim import LocalAdamW
        from weight_sync import sender as sender_module

        super().__init__(workdir, shard=True)
        self._module, self._local = sender_module, sender_module.full_tensor
        self._trainer_module, self._clip = trainer_module, trainer_module.clip_grad_norm
        self._optimizer_class = LocalAdamW
        self._opt_seconds: list[float] = []
        step = self.trainer.optimizer.step

        def timed_step(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self._opt_seconds.append(time.perf_counter() - start)
            return result

        self.trainer.optimizer.step = timed_step

    def block(self, off: tuple[str, ...], steps: int) -> dict[str, float]:
        """Medians over ``steps`` steps with the levers in ``off`` switched off."""
        from torch.distributed.tensor import DTensor

        for group in self.trainer.optimizer.param_groups:
            group["fused"], group["foreach"] = (None, False) if "fused_adamw" in off else (True, None)
        self._optimizer_class.local_step = "local_adamw" not in off
        gathered = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
        self._module.full_tensor = gathered if "local_shard" in off else self._local
        self._trainer_module.clip_grad_norm = (
            (lambda model, max_norm, world: self._clip(model, max_norm, world=2)) if "local_clip" in off else self._clip
        )  # the world > 1 path: clip_grad_norm_ on the DTensors
        background = "background" not in off
        total, publish, train = [], [], []
        self._opt_seconds.clear()
        for _ in range(steps):
            start = time.perf_counter()
            self.trainer.train_step(self.groups, version=self.version)
            trained = time.perf_counter()
            train.append(trained - start)
            self.sender.wait()  # the learner waits for the previous publication at the end of the next step
            self.version += 1
            self.sender.publish(self.version, background=background)
            total.append(time.perf_counter() - start)
            publish.append(time.perf_counter() - trained)
        self.sender.wait()
        return {
            "step": statistics.median(total),
            "publish": statistics.median(publish),
            "optimizer": statistics.median(self._opt_seconds),
            "train": statistics.median(train),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps per block (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every block (default 7; >= 3)")
    args = parser.parse_args(argv)
    repeats = max(3, args.repeats or (3 if args.quick else 7))
    steps = 1 if args.quick else 10

    import torch

    torch.set_num_threads(1)  # as tether up gives the learner of an async run on 2 cores
    sides = {"none": (), **{lever: (lever,) for lever in LEVERS}, "all": LEVERS}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-step-") as tmp:
        learner = Learner(Path(tmp))
        try:
            learner.block((), steps)  # warm-up: first snapshot, first handshake, allocator
            for k in range(repeats):
                rows.append({side: learner.block(sides[side], steps) for side in ordered(list(sides), k)})
        finally:
            learner.close()
    print(
        f"{'lever off':>18} {'s/step':>8} {'train s':>8} {'publish s':>10} {'optimizer s':>12}  (medians; demo, 1 rank)"
    )
    for side in ["none", *LEVERS, "all"]:
        med = {k: statistics.median(r[side][k] for r in rows) for k in ("step", "train", "publish", "optimizer")}
        print(f"{side:>18} {med['step']:>8.4f} {med['train']:>8.4f} {med['publish']:>10.4f} {med['optimizer']:>12.4f}")
    what = "demo model 64x2, 8x8 samples, 8 tokens, 1 gloo rank, filesystem publish to 1 receiver"
    figures = [
        figure(
            "learner_step/step_vs_all_off",
            [r["all"]["step"] / r["none"]["step"] for r in rows],
            goal=None,
            direction="min",
            baseline="the step with every lever off (sync publish, AdamW loop through DTensor dispatch, "
            f"all-gather, clipping on DTensors); {what}",
        ),
        figure(
            "learner_step/optimizer_vs_loop",
            [r["fused_adamw"]["optimizer"] / r["none"]["optimizer"] for r in rows],
            goal=None,
            direction="min",
            baseline=f"optimizer.step with torch's per-tensor AdamW loop on CPU DTensors; {what}",
        ),
        figure(
            "learner_step/optimizer_vs_local_adamw_off",
            [r["local_adamw"]["optimizer"] / r["none"]["optimizer"] for r in rows],
            goal=None,
            direction="min",
            baseline=f"optimizer.step with the fused AdamW kernel through DTensor dispatch; {what}",
        ),
    ]
    for lever in ("background", "local_shard"):
        figures.append(
            figure(
                f"learner_step/critical_publish_vs_{lever}_off",
                [r[lever]["publish"] / r["none"]["publish"] for r in rows],
                goal=None,
                direction="min",
                baseline=f"publication's time on the critical path with {lever} off; {what}",
            )
        )
    for lever in ("local_clip", "local_adamw"):
        figures.append(
            figure(
                f"learner_step/train_vs_{lever}_off",
                [r[lever]["train"] / r["none"]["train"] for r in rows],
                goal=None,
                direction="min",
                baseline=f"the training part of the step with {lever} off; {what}",
            )
        )
    for f in figures:
        report(f, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
