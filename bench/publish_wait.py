"""What a weight publication costs the learner's step: the store transport's stage against today's push.

    python bench/publish_wait.py [--quick] [--repeats N]

With ``max_staleness`` ≥ 1 the learner publishes in the background: ``publish(v, background=True)`` does
the part that reads the model on the step's thread and returns; the rest runs on a thread while the next
step trains, and is waited for at that step's end. Both transports are built in this one process on the
same ~100M-parameter Qwen2-style model (float32 master weights, as the CPU learner holds them; ``--quick``:
the tiny one), with no server listening, so what is timed is the learner's side alone:

* ``push``: today's ``WeightSender`` (filesystem transport: its background delivery writes a snapshot),
  whose staging packs the whole update into bucket buffers;
* ``store``: ``StorePublisher``, whose staging casts the weights into the publish dtype (bfloat16 here,
  as GPU fleets publish), then encodes a delta and writes it on its thread.

Figures: ``stage_push_over_store`` (the step's own cost, push ÷ store; > 1: the store costs the step
less) and, without a goal, ``background_push_over_store`` (the thread's work until ``wait()`` returns).
Each repeat perturbs the weights like a small optimizer step, then runs both sides in an order that
alternates; median and min–max over the repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import figure, ordered, report  # noqa: E402


def _model(quick: bool, folder: Path):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    from bench.weight_sync import model_kwargs
    from tether.commands.tiny_model import make_tiny_model

    path = make_tiny_model(folder / "model", seed=0, **model_kwargs(quick))
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _step(model, seed: int) -> None:  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-6 * torch.randn(p.shape, generator=g))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 repeats: a smoke run, not a measurement")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    repeats = 2 if args.quick else args.repeats

    from tether.config import TetherConfig
    from weight_sync.sender import WeightSender
    from weight_sync.store_publisher import StorePublisher

    with tempfile.TemporaryDirectory(prefix="publish-wait-") as tmp:
        folder = Path(tmp)
        model = _model(args.quick, folder)
        params = sum(p.numel() for p in model.parameters())

        def cfg(transport: dict) -> TetherConfig:
            return TetherConfig.model_validate({
                "run": {"run_id": transport["type"], "output_dir": str(folder / "runs")},
                "weight_sync": {"transport": transport, "publish_dtype": "bfloat16", "keep_snapshots": 1},
            })  # fmt: skip

        senders = {
            "push": WeightSender(cfg({"type": "filesystem"}), model=model, servers=[]),
            "store": StorePublisher(cfg({"type": "store"}), model=model),
        }
        stage: dict[str, list[float]] = {k: [] for k in senders}
        background: dict[str, list[float]] = {k: [] for k in senders}
        try:
            for r in range(repeats + 1):
                _step(model, r)
                for name in ordered(list(senders), r):
                    sender = senders[name]
                    t0 = time.perf_counter()
                    sender.publish(r + 1, background=True)
                    t1 = time.perf_counter()
                    sender.wait()
                    t2 = time.perf_counter()
                    if r:  # repeat 0 warms buffers and the origin / snapshot folders
                        stage[name].append(t1 - t0)
                        background[name].append(t2 - t1)
        finally:
            for sender in senders.values():
                sender.close()
    size = f"{params / 1e6:.1f}M params, float32 master weights, 2 cpus" if not args.quick else "tiny model"
    for name in senders:
        print(f"{name}: stage {statistics.median(stage[name]):.4f} s (min {min(stage[name]):.4f}, max "
              f"{max(stage[name]):.4f}); background {statistics.median(background[name]):.4f} s")  # fmt: skip
    stage_ratio = [p / s for p, s in zip(stage["push"], stage["store"], strict=True)]
    background_ratio = [p / s for p, s in zip(background["push"], background["store"], strict=True)]
    report(figure("weight_service/stage_push_over_store", stage_ratio,
                  goal=None, direction="max",
                  baseline=f"the step's cost of a background publication: today's push (pack into buckets) over the "
                           f"store's stage (cast to bf16); {size}"), quick=args.quick)  # fmt: skip
    report(figure("weight_service/background_push_over_store",
                  background_ratio, goal=None, direction="max",
                  baseline=f"the publication thread's work (push: snapshot write, no server; store: encode + write "
                           f"a delta, no server); {size}"), quick=args.quick)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
