"""Bytes per weight update as versions (full / XOR+zstd / sparse chunks) over real learner steps.

    python bench/weight_delta.py [--quick] [--steps N] [--repeats R] [--lrs 1e-6,1e-5] [--out DIR]
    python bench/weight_delta.py --qwen05b [--qwen-steps 2]     # also a Qwen2.5-0.5B-shaped model (slow on CPU)
    python bench/weight_delta.py --speed-only [--speed-elements 100000000] [--threads T]   # codec speed only

tether's own :class:`learner.trainer.Trainer` (FSDP2, one gloo rank, AdamW at the configured lr, synthetic
groups from :mod:`learner.synthetic`) trains the 256-wide 4-layer tiny model for N steps; after every step
the full float32 master weights are published the way :mod:`weight_sync.store` does it — cast to bf16,
cut into chunks, each chunk the smallest of ``full`` / ``xor_zstd`` / ``sparse`` against the previous
version — and the same weights are published as a full bf16 base, the baseline: what today's full push
sends. Per step, in one process, the two sides alternate which goes first (:func:`bench.common.ordered`):

* bytes: the delta's stored chunk bytes ÷ the full bf16 bytes (also ÷ full fp32 bytes, for reference, and
  a float32 publication's own delta ÷ full fp32, the CPU default's dtype);
* encode: fp32 weights → flat bf16 → chunks with hashes (delta) against the same for a base (cast + hash);
* decode: verify every hash and rebuild from the held version (delta) against verify + copy (base); every
  decoded delta is checked bit for bit against what was published. Both decode into a buffer they reuse
  (a receiver's second set; a fresh one costs a page fault per page). Encode and decode run on one core
  (``torch.set_num_threads(1)`` around them, ``threads=1`` for the chunks); throughput is the model's full
  bf16 bytes over the seconds taken.

Codec speed (:func:`run_speed`, first): one flat bf16 buffer of ``--speed-elements`` (default 100M, a
100M-parameter model's 200 MB) trained by torch's AdamW at ``--speed-lr`` (default 1e-6) on random
gradients; each repeat takes one more step and times ``encode_version`` (cast excluded) and
``decode_version`` (into a reused buffer, checked bit for bit) of that step's delta with ``threads=1`` and
with the default pool (``min(4, cpus)``, or ``--threads``), in alternating order, in the same run.
Throughput is the full bf16 bytes over the seconds taken (median, min–max over the repeats); a modelled
line adds the delta's bytes at 1 Gbit/s and compares with sending the full bytes at 1 Gbit/s (the link is
not measured).

A repeat is one seed (batches and init of the run); its figure is the mean over its steps (bytes) or
its steps' median (time ratios); the printed figure is the median over ≥ 3 repeats with the min–max.
Each repeat also runs the real directory store (base every ``--base-every``, delta beside each base): a
reader that follows every version, and a new reader at the last version (base + chain), both checked
bit-exact; "new reader, worst version" is the most a reader starting from nothing fetches at any version
(the base and the deltas after it, as the store plans it). Timing is never asserted anywhere; a test only
runs ``--quick``. Results: a table on stdout, ``FIGURE`` lines, and ``results.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report

MB = 1e6


def hash_speeds(size: int = 8 * 2**20, rounds: int = 5) -> dict[str, float]:
    """MB/s of the hashes a manifest could use, on this CPU (median of ``rounds``)."""
    import xxhash

    data = os.urandom(size)
    fns = {
        "xxh3_128": xxhash.xxh3_128_hexdigest,
        "xxh64": xxhash.xxh64_hexdigest,
        "blake2b": lambda d: hashlib.blake2b(d).hexdigest(),
        "sha256": lambda d: hashlib.sha256(d).hexdigest(),
    }
    out = {}
    for name, fn in fns.items():
        took = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn(data)
            took.append(time.perf_counter() - t0)
        out[name] = size / statistics.median(took) / MB
    return out


def run_speed(*, elements: int, lr: float, repeats: int, chunk_bytes: int, threads: int) -> dict:
    """Encode / decode throughput of a delta on ``elements`` bf16 weights after real AdamW steps, per pool size."""
    import numpy as np
    import torch

    from weight_sync.delta import Codec
    from weight_sync.versions import decode_version, encode_version, flatten

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(elements) * 0.02)
    opt = torch.optim.AdamW([weight], lr=lr, fused=True)

    def step() -> None:
        weight.grad = torch.randn(elements)
        opt.step()

    for _ in range(2):  # past Adam's first steps, whose update is lr * sign(grad) for every element
        step()
    named = [("weight", weight.detach())]
    prev, cur = flatten(named, version=0, dtype="bfloat16"), None
    into = flatten(named, version=0, dtype="bfloat16")  # a receiver's second set, touched once
    sides = [1] if threads == 1 else [1, threads]
    took: dict[int, dict[str, list[float]]] = {t: {"encode": [], "decode": []} for t in sides}
    ratios, changed = [], []
    codec = Codec()
    for rep in range(repeats):
        step()
        cur = flatten(named, version=prev.version + 1, dtype="bfloat16", reuse=cur)
        changed.append(float(np.count_nonzero(cur.bits != prev.bits) / cur.bits.size))
        manifests = {}
        for t in ordered(sides, rep):
            t0 = time.perf_counter()
            m, payloads = encode_version(cur, prev, chunk_bytes=chunk_bytes, codec=codec, threads=t)
            took[t]["encode"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = decode_version(m, _reader(m, payloads), prev, codec=codec, reuse=into, threads=t)
            took[t]["decode"].append(time.perf_counter() - t0)
            if not np.array_equal(got.bits, cur.bits):
                raise SystemExit(
                    f"speed run, repeat {rep}, threads {t}: the decoded version differs from the published bits"
                )
            manifests[t] = m
        if len({tuple(m.chunks) for m in manifests.values()}) != 1:
            raise SystemExit(f"speed run, repeat {rep}: the manifest differs between thread counts {sides}")
        ratios.append(m.stored_bytes / cur.bits.nbytes)
        prev, cur = cur, prev
    full = prev.bits.nbytes
    mbps = {str(t): {k: [full / x / MB for x in v] for k, v in d.items()} for t, d in took.items()}
    return {"elements": elements, "lr": lr, "full_bf16_bytes": full, "repeats": repeats, "threads": sides,
            "changed_bf16": changed, "delta_vs_full_bf16": ratios, "seconds": {str(t): v for t, v in took.items()},
            "MBps": mbps}  # fmt: skip


def print_speed(speed: dict, *, quick: bool) -> None:
    """The speed run's table, the thread speed-up figures and the modelled update against a 1 Gbit/s push."""
    full, n = speed["full_bf16_bytes"], speed["elements"]
    print(f"\ncodec speed: {n / 1e6:.0f}M bf16 elements ({full / MB:.0f} MB), AdamW lr {speed['lr']:g}, changed "
          f"{_cell(speed['changed_bf16'], '.2%')}, delta / full bf16 {_cell(speed['delta_vs_full_bf16'], '.4f')}; "
          f"MB/s of full bf16 bytes, median (min–max) over {speed['repeats']} repeats")  # fmt: skip
    print("| threads | encode MB/s | decode MB/s | encode + decode s |")
    print("| --- | --- | --- | --- |")
    for t in speed["threads"]:
        mbps, secs = speed["MBps"][str(t)], speed["seconds"][str(t)]
        both = [e + d for e, d in zip(secs["encode"], secs["decode"], strict=True)]
        print(f"| {t} | {_cell(mbps['encode'], '.0f')} | {_cell(mbps['decode'], '.0f')} | {_cell(both, '.3f')} |")
    link = 1e9 / 8  # bytes/s of a 1 Gbit/s link
    t = speed["threads"][-1]
    secs = speed["seconds"][str(t)]
    model = [(e + r * full / link + d) / (full / link)
             for e, d, r in zip(secs["encode"], secs["decode"], speed["delta_vs_full_bf16"], strict=True)]  # fmt: skip
    print(f"modelled (link not measured): encode + delta bytes at 1 Gbit/s + decode, threads {t}, is "
          f"{_cell(model, '.3f')} of sending the full bf16 bytes at 1 Gbit/s ({full / link:.2f} s)")  # fmt: skip
    if len(speed["threads"]) > 1:
        one = speed["seconds"]["1"]
        for key in ("encode", "decode"):
            gains = [a / b for a, b in zip(one[key], secs[key], strict=True)]
            fig = figure(f"weight_delta/{key}_threads{t}_speedup", gains, goal=None, direction="min",
                         baseline=f"the same {key} with threads=1, same run; {n / 1e6:.0f}M bf16 elements, "
                         f"AdamW lr {speed['lr']:g}, {os.cpu_count()} cpus")  # fmt: skip
            report(fig, quick=quick)
            speed.setdefault("figures", []).append({**fig.__dict__, "spread": list(fig.spread)})


def _named_full(model):  # type: ignore[no-untyped-def]
    """Full (unsharded) float32 master weights, as the weight sender gathers them."""
    from torch.distributed.tensor import DTensor

    return [(n, p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]


def run_repeat(*, model_dir: str, lr: float, seed: int, steps: int, chunk_bytes: int, base_every: int,
               groups: tuple[int, int], completion: tuple[int, int], vocab: int, fp32_ref: bool = True,
               store_check: bool = True, log: bool = False) -> dict:  # fmt: skip
    """One seed at one lr: ``steps`` trainer steps, each published both ways. Returns per-step records.

    ``store_check``: also publish into a real directory store and read it back (a follower, a newcomer)."""
    import numpy as np
    import torch

    from learner.parallelize import load_model, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tether.config import TetherConfig
    from weight_sync.delta import Codec
    from weight_sync.store import VersionStore, VersionWriter
    from weight_sync.versions import decode_version, encode_version, flatten

    cfg = TetherConfig.model_validate({"model": {"path": model_dir}, "rollout": {"max_tokens": completion[1]},
                                       "learner": {"train_batch_size": groups[0], "lr": lr}})  # fmt: skip
    torch.manual_seed(seed)
    cpu = torch.device("cpu")
    trainer = Trainer(cfg, parallelize(load_model(cfg, cpu), cfg, cpu), device=cpu, ref_model=None)
    codec = Codec()

    with tempfile.TemporaryDirectory() as tmp:
        store = VersionStore(tmp, fsync=False)
        publisher = VersionWriter(store, dtype="bfloat16", base_every=base_every, chunk_bytes=chunk_bytes)
        named = _named_full(trainer.model)
        prev = flatten(named, version=0, dtype="bfloat16")
        prev32 = flatten(named, version=0, dtype="float32") if fp32_ref else None
        spare = full_buf = None
        # Decoding lands in a buffer of its own per side, touched once here: a receiver keeps a second set.
        into = {
            "delta": flatten(named, version=0, dtype="bfloat16"),
            "full": flatten(named, version=0, dtype="bfloat16"),
        }
        if store_check:
            publisher.publish(0, named)
            follower = store.fetch(0)
        records = []
        for step in range(1, steps + 1):
            batch = make_groups(groups[0], groups[1], vocab=vocab, seed=1000 * seed + step, completion_len=completion)
            trainer.train_step(batch, version=step - 1)
            named = _named_full(trainer.model)
            took: dict[str, float] = {}
            threads = torch.get_num_threads()
            # One core for the publication, as a background publisher thread has: with two intra-op threads
            # on a 2-core machine the cast's time jumped 5-30x whenever another process held a core.
            torch.set_num_threads(1)
            for side in ordered(["delta", "full"], step):
                t0 = time.perf_counter()
                if side == "delta":
                    cur = flatten(named, version=step, dtype="bfloat16", reuse=spare)
                    m_d, p_d = encode_version(cur, prev, chunk_bytes=chunk_bytes, codec=codec, threads=1)
                else:
                    full_buf = flatten(named, version=step, dtype="bfloat16", reuse=full_buf)
                    m_b, p_b = encode_version(full_buf, None, chunk_bytes=chunk_bytes, codec=codec, threads=1)
                took["encode" if side == "delta" else "full_encode"] = time.perf_counter() - t0
            for side in ordered(["delta", "full"], step + 1):
                t0 = time.perf_counter()
                if side == "delta":
                    got = decode_version(m_d, _reader(m_d, p_d), prev, codec=codec, reuse=into[side], threads=1)
                else:
                    got = decode_version(m_b, _reader(m_b, p_b), None, codec=codec, reuse=into[side], threads=1)
                took["decode" if side == "delta" else "full_decode"] = time.perf_counter() - t0
                if not np.array_equal(got.bits, cur.bits):
                    raise SystemExit(f"step {step}: the decoded {side} version differs from the published bits")
                del got
            torch.set_num_threads(threads)
            rec = {"step": step, "changed_bf16": float(np.count_nonzero(cur.bits != prev.bits) / cur.bits.size),
                   "delta_bytes": m_d.stored_bytes, "manifest_bytes": len(m_d.to_json()),
                   "full_bf16_bytes": cur.bits.nbytes, "full_fp32_bytes": 2 * cur.bits.nbytes,
                   "picks": dict(Counter(c.encoding for c in m_d.chunks)), **took}  # fmt: skip
            del m_b, p_b, p_d
            if prev32 is not None:
                cur32 = flatten(named, version=step, dtype="float32")
                m32, _ = encode_version(cur32, prev32, chunk_bytes=chunk_bytes, codec=codec)
                rec["changed_fp32"] = float(np.count_nonzero(cur32.bits != prev32.bits) / cur32.bits.size)
                rec["fp32_delta_bytes"] = m32.stored_bytes
                prev32 = cur32
            if store_check:  # the real store: base every base_every, a delta beside it; a reader that follows
                publisher.publish(step, named)
                follower = store.fetch(step, held=follower)
                rec["follower_bytes"] = follower.fetched_bytes
                if not np.array_equal(follower.bits, cur.bits):
                    raise SystemExit(f"step {step}: the store's follower differs from the published bits")
            del named
            records.append(rec)
            if log:
                print(f"  lr {lr:g} step {step}: changed {rec['changed_bf16']:.2%}, delta/full bf16 "
                      f"{rec['delta_bytes'] / rec['full_bf16_bytes']:.4f}, encode {rec['encode']:.2f} s "
                      f"(full {rec['full_encode']:.2f} s), decode {rec['decode']:.2f} s "
                      f"(full {rec['full_decode']:.2f} s)", flush=True)  # fmt: skip
            spare, prev = prev, cur
        out = {"seed": seed, "lr": lr, "steps": records, "full_bf16_bytes": prev.bits.nbytes}
        if store_check:
            newcomer = store.fetch(steps)
            if not np.array_equal(newcomer.bits, prev.bits):
                raise SystemExit("a new reader's version differs from the published bits")
            out["new_reader_bytes"] = newcomer.fetched_bytes
            out["new_reader_chain"] = [f"v{m.version}:{m.kind}" for m in store.plan(steps)]
            # What a reader starting from nothing fetches at each version (a base and the deltas after it).
            out["new_reader_max_bytes"] = max(sum(m.stored_bytes for m in store.plan(v)) for v in range(steps + 1))
    return out


def _reader(manifest, payloads):  # type: ignore[no-untyped-def]
    """Chunk k's stored bytes, from memory: the decode timing is the decoder's, not a disk's."""
    return lambda k: payloads[manifest.chunks[k].hash]


def summarize(rep: dict) -> dict:
    """One repeat's figures from its steps."""
    s = rep["steps"]
    full = sum(r["full_bf16_bytes"] for r in s)
    out = {
        "changed_bf16": statistics.mean(r["changed_bf16"] for r in s),
        "delta_vs_full_bf16": sum(r["delta_bytes"] for r in s) / full,
        "delta_vs_full_fp32": sum(r["delta_bytes"] for r in s) / (2 * full),
        "manifest_vs_full_bf16": sum(r["manifest_bytes"] for r in s) / full,
        "encode_MBps": full / sum(r["encode"] for r in s) / MB,
        "full_encode_MBps": full / sum(r["full_encode"] for r in s) / MB,
        "decode_MBps": full / sum(r["decode"] for r in s) / MB,
        "full_decode_MBps": full / sum(r["full_decode"] for r in s) / MB,
        "encode_s_vs_full": statistics.median(r["encode"] / r["full_encode"] for r in s),
        "decode_s_vs_full": statistics.median(r["decode"] / r["full_decode"] for r in s),
        "step_delta_vs_full_bf16_min": min(r["delta_bytes"] / r["full_bf16_bytes"] for r in s),
        "step_delta_vs_full_bf16_max": max(r["delta_bytes"] / r["full_bf16_bytes"] for r in s),
        "picks": dict(sum((Counter(r["picks"]) for r in s), Counter())),
    }
    if "new_reader_bytes" in rep:
        out["follower_vs_full_bf16"] = sum(r["follower_bytes"] for r in s) / full
        out["new_reader_vs_full_bf16"] = rep["new_reader_bytes"] / rep["full_bf16_bytes"]
        out["new_reader_max_vs_full_bf16"] = rep["new_reader_max_bytes"] / rep["full_bf16_bytes"]
    if "fp32_delta_bytes" in s[0]:
        out["changed_fp32"] = statistics.mean(r["changed_fp32"] for r in s)
        out["fp32_delta_vs_full_fp32"] = sum(r["fp32_delta_bytes"] for r in s) / (2 * full)
    return out


def _cell(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


COLUMNS = (  # (summary key, header, format)
    ("changed_bf16", "changed bf16 %", ".2%"),
    ("delta_vs_full_bf16", "delta / full bf16", ".4f"),
    ("delta_vs_full_fp32", "delta / full fp32", ".4f"),
    ("fp32_delta_vs_full_fp32", "fp32-pub delta / full fp32", ".3f"),
    ("manifest_vs_full_bf16", "manifest / full bf16", ".4f"),
    ("new_reader_max_vs_full_bf16", "new reader, worst version / full bf16", ".2f"),
    ("encode_MBps", "encode MB/s", ".0f"),
    ("full_encode_MBps", "full encode MB/s", ".0f"),
    ("decode_MBps", "decode MB/s", ".0f"),
    ("full_decode_MBps", "full decode MB/s", ".0f"),
)


def print_table(label: str, runs: dict[str, list[dict]]) -> None:
    cols = [c for c in COLUMNS if all(c[0] in s for reps in runs.values() for s in reps)]
    print(f"\n{label}: median (min–max) over repeats")
    print("| lr | repeats | " + " | ".join(h for _, h, _ in cols) + " | chunk picks |")
    print("| --- | --- | " + " | ".join("---" for _ in cols) + " | --- |")
    for lr, sums in runs.items():
        picks = sum((Counter(s["picks"]) for s in sums), Counter())
        cells = [_cell([s[k] for s in sums], f) for k, _, f in cols]
        print(f"| {lr} | {len(sums)} | " + " | ".join(cells) + f" | {dict(picks)} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="64-wide 2-layer model, 2 steps (seconds; not a measurement)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per repeat (default 20, quick 2)")
    p.add_argument("--repeats", type=int, default=3, help="seeds per lr (>= 3)")
    p.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates")
    p.add_argument("--chunk-mb", type=float, default=None, help="chunk size in MiB (default: the library's, 4)")
    p.add_argument("--base-every", type=int, default=10, help="a full base every K versions (the store run)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/weight_delta"), help="folder for results.json")
    p.add_argument("--qwen05b", action="store_true", help="also a Qwen2.5-0.5B-shaped model (slow on CPU)")
    p.add_argument("--qwen-steps", type=int, default=2, help="learner steps for --qwen05b (one repeat per lr)")
    p.add_argument("--skip-tiny", action="store_true", help="only the --qwen05b part (and the codec speed run)")
    p.add_argument(
        "--speed-elements",
        type=int,
        default=None,
        help="bf16 elements of the codec speed run (default 100M, quick 4M; 0 skips it)",
    )
    p.add_argument("--speed-lr", type=float, default=1e-6, help="AdamW lr of the codec speed run")
    p.add_argument("--threads", type=int, default=None, help="the pool size compared with 1 (default min(4, cpus))")
    p.add_argument("--speed-only", action="store_true", help="only the codec speed run")
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be at least 3 (a figure is a median with its spread)")

    import torch
    import torch.distributed as dist

    from tether.commands.tiny_model import make_tiny_model
    from tether.redis_server import free_port
    from weight_sync.versions import DEFAULT_CHUNK_BYTES, default_threads

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    steps = args.steps or (2 if args.quick else 20)
    lrs = [float(x) for x in args.lrs.split(",") if x]
    chunk_bytes = int(args.chunk_mb * 2**20) if args.chunk_mb else DEFAULT_CHUNK_BYTES
    hidden, layers, heads = (64, 2, 2) if args.quick else (256, 4, 4)
    load = os.getloadavg()
    print(f"host: {platform.node()} ({os.cpu_count()} cpus), load average {load[0]:.2f} at start")
    speeds = hash_speeds()
    print("hash MB/s (8 MiB, median of 5): " + ", ".join(f"{k} {v:.0f}" for k, v in speeds.items()))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    results: dict = {"config": {"steps": steps, "repeats": args.repeats, "lrs": lrs, "chunk_bytes": chunk_bytes,
                                "base_every": args.base_every, "quick": args.quick, "dtype": "bfloat16",
                                "model": f"tiny hidden {hidden}, {layers} layers, {heads} heads"},
                     "host": f"{platform.node()} ({os.cpu_count()} cpus)", "load_average_start": load,
                     "hash_MBps": speeds, "runs": {}, "figures": []}  # fmt: skip
    speed_elements = (
        args.speed_elements if args.speed_elements is not None else 4_000_000 if args.quick else 100_000_000
    )
    try:
        if speed_elements:
            t0 = time.perf_counter()
            threads = args.threads or default_threads()
            results["speed"] = run_speed(elements=speed_elements, lr=args.speed_lr, repeats=args.repeats,
                                         chunk_bytes=chunk_bytes, threads=threads)  # fmt: skip
            print_speed(results["speed"], quick=args.quick)
            print(f"(codec speed run: {time.perf_counter() - t0:.0f} s with the AdamW steps, load average "
                  f"{os.getloadavg()[0]:.2f} at its end)", flush=True)  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            if not args.skip_tiny and not args.speed_only:
                model_dir = str(make_tiny_model(tmp, hidden=hidden, layers=layers, heads=heads))
                run_tiny(args, results, model_dir=model_dir, lrs=lrs, steps=steps, chunk_bytes=chunk_bytes,
                         shape=(hidden, layers, heads))  # fmt: skip
            if args.qwen05b and not args.speed_only:
                results["qwen05b"] = run_qwen(lrs, args.qwen_steps, chunk_bytes, args.base_every, tmp)
    finally:
        dist.destroy_process_group()
    results["load_average_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nresults: {args.out / 'results.json'} (load average {results['load_average_end'][0]:.2f} at the end)")
    return 0


def run_tiny(args: argparse.Namespace, results: dict, *, model_dir: str, lrs: list[float], steps: int,
             chunk_bytes: int, shape: tuple[int, int, int]) -> None:  # fmt: skip
    """The tiny model: ``args.repeats`` seeds per lr, the table and the figures."""
    hidden, layers, _ = shape
    summaries: dict[str, list[dict]] = {}
    for lr in lrs:
        reps = []
        for seed in range(args.repeats):
            rep = run_repeat(model_dir=model_dir, lr=lr, seed=seed, steps=steps, chunk_bytes=chunk_bytes,
                             base_every=args.base_every, groups=(4, 8), completion=(16, 128), vocab=256)  # fmt: skip
            rep["summary"] = summarize(rep)
            reps.append(rep)
            print(f"lr {lr:g} seed {seed}: delta/full bf16 {rep['summary']['delta_vs_full_bf16']:.4f}, "
                  f"changed {rep['summary']['changed_bf16']:.2%}", flush=True)  # fmt: skip
        results["runs"][f"{lr:g}"] = reps
        summaries[f"{lr:g}"] = [r["summary"] for r in reps]
    n_params = reps[0]["full_bf16_bytes"] // 2
    label = f"tiny model ({n_params / 1e6:.2f}M params, hidden {hidden}), {steps} steps, chunks {chunk_bytes >> 10} KiB"
    print_table(label, summaries)
    where = f"cpu, tiny model hidden {hidden} x {layers} layers, {steps} AdamW steps, bf16 publication"
    for lr, sums in summaries.items():
        for key, base in (
            ("delta_vs_full_bf16", "full bf16 bytes of the same version (today's full push)"),
            ("delta_vs_full_fp32", "full fp32 bytes of the same version (reference)"),
            ("encode_s_vs_full", "encoding the same version as a full bf16 base (cast + hash), same step"),
            ("decode_s_vs_full", "decoding the same version's full bf16 base (verify + copy), same step"),
        ):
            fig = figure(f"weight_delta/lr{lr}_{key}", [s[key] for s in sums], goal=None, direction="max",
                         baseline=f"{base}; {where}, lr {lr}")  # fmt: skip
            report(fig, quick=args.quick)
            results["figures"].append({**fig.__dict__, "spread": list(fig.spread)})


def run_qwen(lrs: list[float], steps: int, chunk_bytes: int, base_every: int, tmp: str) -> dict:
    """Qwen2.5-0.5B shape, random weights, one repeat per lr (a look, not a figure: too slow for 3 on CPU)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.learner_mfu import QWEN25_05B

    model_dir = str(Path(tmp) / "qwen05b")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).save_pretrained(model_dir)
    out = {}
    for lr in lrs:
        t0 = time.perf_counter()
        rep = run_repeat(model_dir=model_dir, lr=lr, seed=0, steps=steps, chunk_bytes=chunk_bytes,
                         base_every=base_every, groups=(2, 4), completion=(16, 64), vocab=QWEN25_05B["vocab_size"],
                         fp32_ref=False, store_check=False, log=True)  # fmt: skip
        rep["summary"] = summarize(rep)
        rep["seconds"] = time.perf_counter() - t0
        out[f"{lr:g}"] = rep
    n = out[f"{lrs[0]:g}"]["full_bf16_bytes"] // 2
    print_table(f"Qwen2.5-0.5B shape ({n / 1e6:.0f}M params), {steps} steps, 1 repeat (no spread)",
                {lr: [r["summary"]] for lr, r in out.items()})  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
