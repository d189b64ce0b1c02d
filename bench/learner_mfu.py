"""Learner MFU on one GPU: a Qwen2.5-0.5B-shaped model with random weights, bf16, packed ~4K-token sequences.

    python bench/learner_mfu.py            # on a GPU machine (deploy/gpu-check.sh runs it)
    python bench/learner_mfu.py --quick    # a small shape, on CPU too: checks the script, says nothing of MFU

The figure to set against prime-rl's published 11.1 % MFU (Qwen3-0.6B, 16K context, one H100). The step is
the learner's real one — :class:`learner.trainer.Trainer` on FSDP2 (one rank), remove-padding with the
varlen attention, dynamic batching by ``max_token_len_per_gpu``, the policy loss, the optimizer — on
synthetic groups whose sequences are 3.5–4.5K tokens. Model FLOPs per trained token are
``6·N + 6·L·d·S`` (dense matmuls forward and backward, plus causal attention's score and value products
at the mean sequence length S; N counts the embedding once, as the model ties it to the LM head); MFU is
that over the bf16 dense peak of the device (``learner.telemetry.peak_flops``). Steps after one warm-up
step are timed with CUDA synchronised; the median step and the min–max across steps are printed. Every
timed step is paired with one that has cuDNN's sdpa kernel off (order alternating), and their ratio is printed
too: cuDNN plans per shape, and each step's sequences are new lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}
QUICK = {**QWEN25_05B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip


def model_flops_per_token(n_params: int, *, layers: int, hidden: int, seq_len: float) -> float:
    return 6.0 * n_params + 6.0 * layers * hidden * seq_len


def profile_step(trainer, groups, *, cuda: bool) -> None:  # type: ignore[no-untyped-def]
    """One more step (untimed) under the profiler: where the device time goes, for the next GPU session that
    has to close the MFU gap from one call's output."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        trainer.train_step(groups, version=0)
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=70))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small shape (runs on CPU; no MFU claim)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5, quick 2)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    p.add_argument("--profile", action="store_true", help="also profile one step (always on a GPU without --quick)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.telemetry import peak_flops
    from learner.trainer import Trainer
    from tether.config import TetherConfig
    from tether.redis_server import free_port

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("learner_mfu: needs a CUDA GPU (MFU is a GPU figure); --quick runs a small shape on the CPU")
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    shape = QUICK if args.quick else QWEN25_05B
    steps = args.steps or (2 if args.quick else 5)
    seq = (96, 128) if args.quick else (3584, 4608)  # completion lengths; prompts add 4–12 tokens
    n_groups, group_size = (2, 2) if args.quick else (4, 4)
    budget = 1024 if args.quick else 8192
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**shape)).save_pretrained(tmp)
        cfg = TetherConfig.model_validate(
            {
                "model": {"path": tmp, "attn_implementation": os.environ.get("BENCH_ATTN", "sdpa")},
                "rollout": {"max_tokens": seq[1]},
                "learner": {
                    "train_batch_size": n_groups,
                    "use_remove_padding": True,
                    "use_dynamic_bsz": True,
                    "max_token_len_per_gpu": budget,
                    "log_prob_max_token_len_per_gpu": budget,
                    "param_dtype": "bfloat16",
                    "enable_gradient_checkpointing": not args.quick,
                    "lr": 1e-6,
                },
            }
        )
        model = parallelize(load_model(cfg, device), cfg, device)
        trainer = Trainer(cfg, model, device=device, ref_model=None)
        n_params = sum(p.numel() for p in model.parameters())

        def batch(seed: int):
            return make_groups(n_groups, group_size, vocab=shape["vocab_size"], seed=seed, completion_len=seq)

        # Each timed step runs twice over, on batches of its own: with cuDNN's sdpa kernel allowed (torch's
        # default, what the learner runs) and with it off, the order alternating. cuDNN plans per shape, and
        # every step brings new sequence lengths: in the rollout engine that cost 30+ ms a decode step on an
        # H200; whether the learner pays it too is what the second figure says.
        for on in (True, False):  # warm-up: allocator growth, kernels' first calls, in both modes
            torch.backends.cuda.enable_cudnn_sdp(on)
            trainer.train_step(batch(10_000 + on), version=0)
        by_mode: dict[bool, list[float]] = {True: [], False: []}  # cuDNN sdpa on / off
        lengths = []
        for s in range(steps):
            for on in (True, False) if s % 2 == 0 else (False, True):
                torch.backends.cuda.enable_cudnn_sdp(on)
                groups = batch(2 * s + on)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = trainer.train_step(groups, version=0)
                if cuda:
                    torch.cuda.synchronize()
                by_mode[on].append(out["learner/tokens"] / (time.perf_counter() - t0))
                lengths += [
                    t.prompt_token_ids.shape[0] + t.num_completion_tokens for g in groups for t in g.trajectories
                ]
        torch.backends.cuda.enable_cudnn_sdp(True)
        if args.profile or (cuda and not args.quick):
            profile_step(trainer, batch(10_002), cuda=cuda)
        dist.destroy_process_group()
    per_step_tps = by_mode[True]
    tps, tps_off = statistics.median(per_step_tps), statistics.median(by_mode[False])
    off_vs_on = [off / on for off, on in zip(by_mode[False], per_step_tps, strict=True)]
    flops = model_flops_per_token(n_params, layers=shape["num_hidden_layers"], hidden=shape["hidden_size"],
                                  seq_len=statistics.mean(lengths))  # fmt: skip
    peak = peak_flops(device)
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "params": n_params,
        "mean_seq_len": statistics.mean(lengths),
        "tokens_per_s_median": tps,
        "tokens_per_s_min": min(per_step_tps),
        "tokens_per_s_max": max(per_step_tps),
        "mfu": flops * tps / peak if peak else None,
        "steps": steps,
        "tokens_per_s_cudnn_sdpa_off_median": tps_off,
        "cudnn_sdpa_off_vs_on_median": statistics.median(off_vs_on),
        "cudnn_sdpa_off_vs_on_min": min(off_vs_on),
        "cudnn_sdpa_off_vs_on_max": max(off_vs_on),
    }
    print(f"model: {n_params / 1e6:.0f}M parameters, sequences {result['mean_seq_len']:.0f} tokens on average")
    print(f"tokens/s: median {tps:.0f} (min {min(per_step_tps):.0f}, max {max(per_step_tps):.0f}) over {steps} steps")
    if peak:
        spread = [flops * x / peak for x in (min(per_step_tps), max(per_step_tps))]
        print(f"MFU: {100 * result['mfu']:.1f}% (min {100 * spread[0]:.1f}%, max {100 * spread[1]:.1f}%) of "
              f"{peak / 1e12:.0f} TFLOP/s bf16 — prime-rl publishes 11.1% (Qwen3-0.6B, 16K, one H100)")  # fmt: skip
    else:
        print("MFU: not reported (no bf16 peak known for this device)")
    print(f"cuDNN sdpa off: {tps_off:.0f} tokens/s, {statistics.median(off_vs_on):.2f}x the default "
          f"(min {min(off_vs_on):.2f}, max {max(off_vs_on):.2f}; pairs of steps, order alternating)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
