"""Learner MFU on one GPU: a Qwen2.5-0.5B-shaped model with random weights, bf16, packed ~4K-token sequences,
for the baseline step and each MFU lever alone, then all of them together.

    python bench/learner_mfu.py                         # the matrix, on a GPU machine (deploy/gpu-check.sh)
    python bench/learner_mfu.py --levers baseline,all   # some rows only
    python bench/learner_mfu.py --quick                 # a small shape, on CPU too: checks the script, no MFU

The step is the learner's real one — :class:`learner.trainer.Trainer` (remove-padding, dynamic batching by
``max_token_len_per_gpu``, the policy loss, the optimizer) on synthetic groups whose sequences are 3.5–4.5K
tokens. The rows (:data:`LEVERS`): ``baseline`` is the learner's configuration before the levers (activation
checkpointing on, attention split per sequence, one rank a plain module under autocast, eager); each lever
changes one switch; ``all`` pulls every lever; ``best`` and ``best_fused`` stack the ones that paid on an
H200 (no checkpointing, 16K-token micro-batches, compile; then the fused LM head). On a GPU an untimed baseline
row runs first (the first model on a device ran at half the speed of the same row run last). Each row builds
its model afresh, runs warm-up steps (one eager; with compile, until a step compiles no new graph: at least
two, the second makes lengths dynamic), then ``--steps`` timed steps with CUDA synchronised; the median and
the min–max over steps are printed. Each row draws sequences no earlier row ran, as a training run meets new
lengths: on an H200 the first compiled row ran at 0.43× the same row run again on the same lengths, with no
graph compiled in its timed steps — per-length caches (cuDNN's attention plans) are the likely cause, not
confirmed. ``baseline`` runs first and again last, so drift over the run shows.

MFU two ways, over the device's bf16 dense peak (``learner.telemetry.peak_flops``), N counting the tied
embedding once: tether's ``6·N + 6·L·d·S`` per token (causal attention's score and value products at the
mean length S, half of the full square) and prime-rl's ``6·N + 12·L·H·hd·S`` (the full square; prime-rl
publishes 11.1 % on Qwen3-0.6B at 16K on one H100). Each row is appended to ``--jsonl`` as soon as it ends,
so a run cut short keeps the rows it finished.
"""

from __future__ import annotations

import argparse
import json
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

_BIG = {"max_token_len_per_gpu": 16384, "log_prob_max_token_len_per_gpu": 16384}
LEVERS: dict[str, dict] = {
    "baseline": {},
    "no_checkpointing": {"enable_gradient_checkpointing": False},
    "torch_varlen": {"varlen_attention": "torch"},
    "compile": {"use_torch_compile": True},
    "fsdp_one_rank": {"shard_single_rank": True},
    "fused_lm_head": {"use_fused_kernels": True},
    "all": {"enable_gradient_checkpointing": False, "varlen_attention": "torch", "use_torch_compile": True,
            "shard_single_rank": True, "use_fused_kernels": True},
    # the stacks that paid on an H200 (2026-11-27), for --levers and the default matrix
    "nockpt_varlen": {"enable_gradient_checkpointing": False, "varlen_attention": "torch"},
    "nockpt_varlen_16k": {"enable_gradient_checkpointing": False, "varlen_attention": "torch", **_BIG},
    "nockpt_varlen_16k_compile": {"enable_gradient_checkpointing": False, "varlen_attention": "torch",
                                  "use_torch_compile": True, **_BIG},
    "best": {"enable_gradient_checkpointing": False, "use_torch_compile": True, **_BIG},
    "best_fused": {"enable_gradient_checkpointing": False, "use_torch_compile": True, "use_fused_kernels": True,
                   **_BIG},
}  # fmt: skip
DEFAULT_ROWS = ["baseline", "no_checkpointing", "torch_varlen", "compile", "fsdp_one_rank", "fused_lm_head", "best",
                "best_fused"]  # fmt: skip
BASELINE = {"enable_gradient_checkpointing": True, "varlen_attention": "split", "use_torch_compile": False,
            "shard_single_rank": False, "use_fused_kernels": False}  # fmt: skip
"""The learner's switches before the levers; a row is these with its lever's changes."""


def model_flops_per_token(
    n_params: int, *, layers: int, hidden: int, seq_len: float, causal_half: bool = True
) -> float:
    """tether's count (``causal_half``: ``6·N + 6·L·d·S``) or prime-rl's (``6·N + 12·L·d·S``);
    ``d`` = heads × head_dim."""
    return 6.0 * n_params + (6.0 if causal_half else 12.0) * layers * hidden * seq_len


def profile_step(trainer, groups, *, cuda: bool, out: Path | None) -> None:  # type: ignore[no-untyped-def]
    """One more step (untimed) under the profiler: the top kernels by device time, to ``out`` (or stdout)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        trainer.train_step(groups, version=0)
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70)
    if out is None:
        print(table)
    else:
        out.write_text(table)


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up(trainer, batch, *, compiled: bool, max_steps: int = 6) -> int:  # type: ignore[no-untyped-def]
    """Untimed steps until one compiles no new graph (one step when eager), so that no recompile is timed as a
    step; how many ran."""
    for step in range(1, max_steps + 1):
        before = compiled_graphs()
        trainer.train_step(batch(10_000 + step), version=0)
        if not compiled or (step >= 2 and compiled_graphs() == before):
            return step
    return max_steps


def run_row(name: str, args: argparse.Namespace, shape: dict, model_dir: str, device, *, first_seed: int = 0) -> dict:  # type: ignore[no-untyped-def]
    """Build the model with row ``name``'s switches, warm up, time ``args.steps`` steps; the row's figures.
    Its batches are drawn from seeds ``first_seed`` on: give each row its own, so that no row times sequence
    lengths an earlier row already ran."""
    import gc

    import torch

    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.telemetry import peak_flops
    from learner.trainer import Trainer
    from tether.config import TetherConfig

    cuda = device.type == "cuda"
    seq = (96, 128) if args.quick else (3584, 4608)  # completion lengths; prompts add 4–12 tokens
    n_groups, group_size = (2, 2) if args.quick else (2, 4)
    budget = 1024 if args.quick else 8192
    switches = {**BASELINE, **LEVERS[name]}
    if args.quick:  # CPU: no flash kernel, float32
        switches["varlen_attention"] = (
            "split" if switches["varlen_attention"] == "torch" else switches["varlen_attention"]
        )
    cfg = TetherConfig.model_validate(
        {
            "model": {"path": model_dir, "attn_implementation": "sdpa"},
            "rollout": {"max_tokens": seq[1]},
            "learner": {
                "train_batch_size": n_groups,
                "use_remove_padding": True,
                "use_dynamic_bsz": True,
                "max_token_len_per_gpu": budget,
                "log_prob_max_token_len_per_gpu": budget,
                "param_dtype": "auto" if args.quick else "bfloat16",
                "lr": 1e-6,
                **switches,
            },
        }
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = parallelize(load_model(cfg, device), cfg, device)
    trainer = Trainer(cfg, model, device=device, ref_model=None)
    n_params = sum(p.numel() for p in model.parameters())
    extra = trainer.extra_forward_passes  # forward-only passes (proximal, reference): 2·N per token each

    def batch(seed: int):
        return make_groups(n_groups, group_size, vocab=shape["vocab_size"], seed=first_seed + seed,
                           completion_len=seq)  # fmt: skip

    t_warm = time.perf_counter()
    warmup_steps = warm_up(trainer, batch, compiled=switches["use_torch_compile"])
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t_warm
    tps, lengths = [], []
    for s in range(args.steps):
        groups = batch(s)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = trainer.train_step(groups, version=0)
        if cuda:
            torch.cuda.synchronize()
        tps.append(out["learner/tokens"] / (time.perf_counter() - t0))
        lengths += [t.prompt_token_ids.shape[0] + t.num_completion_tokens for g in groups for t in g.trajectories]
    if args.profile_row == name:
        profile_step(trainer, batch(10_002), cuda=cuda, out=args.profile_out)
    peak = peak_flops(device)
    mean_len = statistics.mean(lengths)
    d = shape["hidden_size"]  # heads × head_dim
    row = {"row": name, "switches": switches, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "params": n_params, "extra_forward_passes": extra, "mean_seq_len": mean_len, "steps": args.steps,
           "warmup_s": warmup_s, "warmup_steps": warmup_steps,
           "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
           "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}  # fmt: skip
    for key, half in (("mfu", True), ("mfu_prime_rl", False)):
        flops = model_flops_per_token(n_params, layers=shape["num_hidden_layers"], hidden=d, seq_len=mean_len,
                                      causal_half=half)  # fmt: skip
        flops += 2.0 * n_params * extra
        row[key] = flops * row["tokens_per_s_median"] / peak if peak else None
        row[f"{key}_min"] = flops * min(tps) / peak if peak else None
        row[f"{key}_max"] = flops * max(tps) / peak if peak else None
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def describe(row: dict, base: dict | None) -> str:
    pct = (lambda x: f"{100 * x:5.1f}%") if row["mfu"] is not None else (lambda x: "   n/a")
    vs = f"{row['tokens_per_s_median'] / base['tokens_per_s_median']:.2f}x" if base else "  -  "
    mem = f"{row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] is not None else "-"
    return (f"{row['row']:<17} {row['tokens_per_s_median']:>9.0f} ({row['tokens_per_s_min']:.0f}–"
            f"{row['tokens_per_s_max']:.0f})  {vs:>6}  MFU {pct(row['mfu'] or 0)} "
            f"(prime-rl's {pct(row['mfu_prime_rl'] or 0)})  peak {mem}  warm-up {row['warmup_s']:.0f} s "
            f"({row['warmup_steps']} steps)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small shape (runs on CPU; no MFU claim)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (default 3)")
    p.add_argument(
        "--levers", default=",".join(DEFAULT_ROWS), help=f"rows to run, in order (known: {','.join(LEVERS)})"
    )
    p.add_argument("--jsonl", type=Path, default=None, help="append each row's figures to this file as it ends")
    p.add_argument("--json", type=Path, default=None, help="also write all rows to this file at the end")
    p.add_argument("--profile-row", default="best_fused", help="profile one more step of this row")
    p.add_argument("--profile-out", type=Path, default=None, help="write the profile table here (default stdout)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.distributed import cuda_allocator_defaults
    from tether.redis_server import free_port

    rows = [r.strip() for r in args.levers.split(",") if r.strip()]
    unknown = [r for r in rows if r not in LEVERS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(LEVERS)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("learner_mfu: needs a CUDA GPU (MFU is a GPU figure); --quick runs a small shape on the CPU")
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        cuda_allocator_defaults()  # the learner's own setting (learner.distributed)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    shape = QUICK if args.quick else QWEN25_05B
    if rows and rows[0] == "baseline" and len(rows) > 2:
        rows.append("baseline")  # again last: drift over the run shows
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**shape)).save_pretrained(tmp)
        if cuda:  # the first model on a device pays for kernels' first loads and the allocator's growth
            t0 = time.perf_counter()
            run_row("baseline", argparse.Namespace(**{**vars(args), "steps": 1, "profile_row": ""}), shape, tmp, device)
            print(f"warm-up row (baseline, discarded): {time.perf_counter() - t0:.0f} s", flush=True)
        for i, name in enumerate(rows, start=1):
            try:
                row = run_row(name, args, shape, tmp, device, first_seed=100_000 * i)
            except Exception as e:
                row = {"row": name, "error": f"{type(e).__name__}: {e}"[:2000]}
                print(f"{name:<17} FAILED: {row['error']}", flush=True)
                if cuda:
                    torch.cuda.empty_cache()
            else:
                base = next((r for r in results if r["row"] == "baseline" and "error" not in r), None)
                print(describe(row, base if name != "baseline" else None), flush=True)
            results.append(row)
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()
    done = [r for r in results if "error" not in r]
    if done:
        print(f"model: {done[0]['params'] / 1e6:.0f}M parameters, sequences {done[0]['mean_seq_len']:.0f} tokens "
              f"on average, {args.steps} timed steps a row; tokens/s median (min–max), x the baseline")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if len(done) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
