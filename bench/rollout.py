"""gRPC serving overhead: generated tokens/s through ``Rollout.Generate`` vs the same engine in-process.

    python bench/rollout.py [--quick] [--model DIR] [--engine transformers|vllm]

Both sides use the same engine type, settings and prompts in one run: the baseline calls
``engine.generate`` directly in this process; the measured side starts ``python -m rollout_server`` as
a child and drives it with ``AsyncRolloutClient``. Each concurrency level (1, 8, 64 clients, each
sending one request at a time) runs on both, alternately, after a warm-up. Goal: ratio >= 0.95.
Timings are printed, never asserted. With no ``--model`` a tiny model is built in a temp folder.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONCURRENCY = (1, 8, 64)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests and tokens (seconds, for tests)")
    p.add_argument("--model", default="", help="local HF model folder (default: a tiny model built now)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per request (default 16 quick / 64)")
    return p.parse_args()


async def drive(call, n_requests: int, concurrency: int) -> tuple[int, float]:
    """Run ``n_requests`` calls with ``concurrency`` workers; returns (generated tokens, seconds)."""
    queue = list(range(n_requests))
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            tokens = await call(queue.pop())  # await first: `total += await ...` would read total before
            total += tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total, time.perf_counter() - start


async def main() -> int:
    args = parse()
    from rollout_server.engines import SamplingSpec, build_engine
    from rollout_server.launch import spawn_server
    from tether.client import AsyncRolloutClient
    from tether.config import load_config
    from tether.redis_server import free_port

    tmp = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    model = args.model
    if not model:
        from tether.tiny_model import make_tiny_model

        model = str(make_tiny_model(tmp / "tiny", hidden=128, layers=2, heads=4, seed=0))
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    engine_cfg = (
        "{type: transformers, max_num_seqs: 64, batch_wait_ms: 10}"
        if args.engine == "transformers"
        else "{type: vllm, enforce_eager: true, max_num_seqs: 64}"
    )
    overrides = [
        "--model.path",
        model,
        "--rollout.engine",
        engine_cfg,
        "--rollout.max_tokens",
        str(max_tokens),
        "--rollout.max_n",
        "64",
        "--rollout.prompt_workers",
        "0",
    ]
    cfg = load_config(None, overrides)
    prompts = [f"prompt number {i}: " for i in range(256)]
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=max_tokens)

    print(f"engine={args.engine} model={model} max_tokens={max_tokens} quick={args.quick}", flush=True)
    print("starting the rollout server process ...", flush=True)
    server = spawn_server(overrides, port=free_port(), log_path=tmp / "server.log", wait_s=600)
    engine = build_engine(cfg)
    await engine.start()
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    rows = []
    try:
        async with AsyncRolloutClient(server.address, timeout_s=600) as client:

            async def local(i: int) -> int:
                (s,) = await engine.generate(ids[i % len(ids)], spec)
                return len(s.token_ids)

            async def remote(i: int) -> int:
                out = await client.generate(token_ids=ids[i % len(ids)], n=1, max_tokens=max_tokens, temperature=1.0)
                return len(out.samples[0].token_ids)

            await drive(local, 4, 2)  # warm-up: first-call allocations, thread pools, channel connect
            await drive(remote, 4, 2)
            for c in CONCURRENCY:
                n_requests = max(2 * c, 8) if args.quick else max(4 * c, 32)
                tok_l, sec_l = await drive(local, n_requests, c)
                tok_r, sec_r = await drive(remote, n_requests, c)
                rows.append((c, n_requests, tok_l / sec_l, tok_r / sec_r))
                print(
                    f"  concurrency {c:>3}: in-process {tok_l / sec_l:9.1f} tok/s, gRPC {tok_r / sec_r:9.1f} tok/s",
                    flush=True,
                )
    finally:
        await engine.shutdown()
        server.terminate()

    print()
    print("| clients | requests | in-process tok/s | gRPC tok/s | ratio gRPC/in-process |")
    print("|--------:|---------:|-----------------:|-----------:|----------------------:|")
    for c, n, local_rate, remote_rate in rows:
        print(f"| {c:>7} | {n:>8} | {local_rate:>16.1f} | {remote_rate:>10.1f} | {remote_rate / local_rate:>21.3f} |")
    worst = min(r[3] / r[2] for r in rows)
    print(f"\nworst ratio {worst:.3f} (goal >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
