"""What recording the run's timeline costs the learner: steps/s with ``run.trace`` on over off.

    python bench/trace_overhead.py [--quick] [--repeats N] [--steps N]

The demo learner's loop in one process (:class:`bench.demo_rank.DemoRank`: the demo model, 64 wide × 2 layers, one gloo
rank, 8 prompts × 8 samples of 8 tokens, a filesystem publication every step to one standalone receiver
process, in the background as a ``max_staleness: 1`` run does), with the spans ``learner/main.py`` records
around it (``wait_data``, ``train_step``, ``weight_sync_wait``, ``publish``) and those the trainer and the
sender record inside it (``forward``, ``backward``, ``optimizer``, ``weight_transfer``, ``weight_commit``):
~9 spans a step, flushed to a file once a second by :mod:`tether.spans`' thread, as in a run. Blocks of
``--steps`` steps with tracing on and off alternate, the order swapping from repeat to repeat
(:func:`bench.common.ordered`).

Figure: ``trace/steps_per_s_on_over_off`` (goal ≥ 0.97: ``run.trace`` defaults to on because it meets it).
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


def block(learner: DemoRank, *, steps: int, trace: Path | None) -> tuple[float, int]:
    """Steps/s over ``steps`` demo learner steps, recording spans into ``trace`` (None: off); spans written."""
    from learner.telemetry import nvtx
    from tether import spans

    rec = spans.start(trace, process="learner-rank0", enabled=trace is not None) if trace else None
    start = time.perf_counter()
    for _ in range(steps):
        with spans.span("wait_data", step=learner.version + 1):
            pass  # the buffer read: in a run it waits for rollouts; here the groups are at hand
        with nvtx("train_step", step=learner.version + 1):
            learner.trainer.train_step(learner.groups, version=learner.version)
        with nvtx("weight_sync_wait"):
            learner.sender.wait()
        learner.version += 1
        with nvtx("publish", version=learner.version):
            learner.sender.publish(learner.version, background=True)
    learner.sender.wait()
    rate = steps / (time.perf_counter() - start)
    spans.stop()
    written = 0
    if rec is not None and rec.path.exists():
        written = sum(1 for _ in rec.path.open())
        rec.path.unlink()  # the next block starts an empty file
    return rate, written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps per block (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="on/off pairs (default 7; >= 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block (default 40)")
    args = parser.parse_args(argv)
    repeats = max(3, args.repeats or (3 if args.quick else 7))
    steps = args.steps or (3 if args.quick else 40)

    import torch

    torch.set_num_threads(1)  # as tether up gives the learner of an async run on 2 cores
    ratios, on_rates, off_rates, per_step = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="tether-bench-trace-") as tmp:
        learner = DemoRank(Path(tmp))
        try:
            block(learner, steps=max(2, steps // 4), trace=None)  # warm-up: first snapshot, handshake, allocator
            for k in range(repeats):
                rate: dict[str, float] = {}
                for side in ordered(["on", "off"], k):
                    rate[side], written = block(
                        learner, steps=steps, trace=Path(tmp) / "spans" if side == "on" else None
                    )
                    if side == "on":
                        per_step.append(written / steps)
                ratios.append(rate["on"] / rate["off"])
                on_rates.append(rate["on"])
                off_rates.append(rate["off"])
                print(f"repeat {k + 1}: on {rate['on']:.2f} steps/s, off {rate['off']:.2f} steps/s, "
                      f"ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
        finally:
            learner.close()
    print(f"medians: on {statistics.median(on_rates):.2f} steps/s, off {statistics.median(off_rates):.2f} steps/s; "
          f"{statistics.median(per_step):.1f} spans recorded per step")  # fmt: skip
    report(
        figure(
            "trace/steps_per_s_on_over_off",
            ratios,
            goal=0.97,
            direction="min",
            baseline=f"the same loop with run.trace off; demo model 64x2, 8x8 samples, 8 tokens, 1 gloo rank, "
            f"background filesystem publish to 1 receiver, {steps} steps per block",
        ),
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
