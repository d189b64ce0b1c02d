"""Load on one rollout server: latency, throughput, errors by status code, memory, and backpressure.

    python bench/load.py [--quick] [--clients M] [--seconds S] [--max-concurrent N]

Starts an embedded Redis and one ``python -m rollout_server`` (transformers engine, a tiny model built
in a temp folder, ``rollout.max_concurrent_requests`` = N) and runs three phases, each for S seconds:

* ``generate``: M async clients, each sending one Generate at a time;
* ``episode``: M clients, each looping open → 2 steps → close (episodes are written to Redis);
* ``backpressure``: 4·N clients against a limit of N — the server must answer RESOURCE_EXHAUSTED at
  once for what is over the limit rather than queue it, so latency and memory stay bounded.

Prints one table row per phase: calls, p50/p99 latency (one call; a whole episode for ``episode``),
successful calls per second, error counts by status code, and the server's RSS (VmRSS in
/proc/<pid>/status) before and after. The three phases run ``--repeats`` times (default 3), their order
rotating from repeat to repeat, and give three figures, each the median of per-repeat values with the
min–max — the server measured against itself within its limit, since what is claimed is that overload
is refused rather than queued:

* ``load/backpressure_goodput``: successful calls/s under 4× overload ÷ calls/s of the ``generate``
  phase within the limit (goal ≥ 0.8: refusing work must not cost the work that is admitted);
* ``load/backpressure_rss_growth``: server RSS after ÷ before the overload phase (goal ≤ 1.1: flat);
* ``load/refusal_vs_call_latency``: p50 latency of a RESOURCE_EXHAUSTED answer ÷ p50 latency of a
  served Generate (goal ≤ 0.5: refused at once, not after waiting in a queue).

Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short phases and few clients (seconds, for tests)")
    p.add_argument("--clients", type=int, default=0, help="concurrent clients (default 4 quick / 16)")
    p.add_argument("--seconds", type=float, default=0.0, help="length of each phase (default 3 quick / 20)")
    p.add_argument("--max-concurrent", type=int, default=8, help="rollout.max_concurrent_requests of the server")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per generation")
    p.add_argument("--repeats", type=int, default=3, help="times the three phases run (order rotating; >= 3)")
    return p.parse_args()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.codes: collections.Counter[str] = collections.Counter()
        self.refusals: list[float] = []  # RESOURCE_EXHAUSTED answers: they must come back at once

    def record(self, code: str, seconds: float) -> None:
        self.codes[code] += 1
        if code == "OK":
            self.latencies.append(seconds)
        elif code == "RESOURCE_EXHAUSTED":
            self.refusals.append(seconds)

    def quantile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


async def timed(tally: Tally, coro) -> bool:  # type: ignore[no-untyped-def]
    import grpc

    start = time.perf_counter()
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        tally.record(e.code().name, time.perf_counter() - start)
        return False
    tally.record("OK", time.perf_counter() - start)
    return True


async def generate_loop(client, tally: Tally, until: float, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    i = 0
    while time.monotonic() < until:
        await timed(tally, client.generate(text=f"load {i}:", n=1, max_tokens=max_tokens, temperature=1.0))
        i += 1


async def episode_loop(client, tally: Tally, until: float, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    import grpc

    while time.monotonic() < until:
        start = time.perf_counter()
        try:
            ep = await client.open_episode(text="count:", max_tokens=max_tokens)
            await client.step(ep.episode_id)
            await client.step(ep.episode_id, observation=" more:")
            await client.close_episode(ep.episode_id, reward=1.0)
        except grpc.aio.AioRpcError as e:
            tally.record(e.code().name, time.perf_counter() - start)
            continue
        tally.record("OK", time.perf_counter() - start)


async def phase(address: str, loop_fn, clients: int, seconds: float, max_tokens: int) -> tuple[Tally, float]:  # type: ignore[no-untyped-def]
    from tether.client import AsyncRolloutClient

    tally = Tally()
    conns = [AsyncRolloutClient(address, timeout_s=60) for _ in range(clients)]
    start = time.monotonic()
    until = start + seconds
    try:
        await asyncio.gather(*(loop_fn(c, tally, until, max_tokens) for c in conns))
    finally:
        for c in conns:
            await c.close()
    return tally, time.monotonic() - start


def row(name: str, clients: int, tally: Tally, elapsed: float, rss: tuple[float, float]) -> str:
    calls = sum(tally.codes.values())
    errors = ", ".join(f"{k}={v}" for k, v in sorted(tally.codes.items()) if k != "OK") or "-"
    return (
        f"| {name} | {clients} | {calls} | {tally.quantile(0.5) * 1e3:.1f} | {tally.quantile(0.99) * 1e3:.1f} "
        f"| {tally.codes['OK'] / elapsed:.1f} | {(calls - tally.codes['OK']) / max(calls, 1):.1%} | {errors} "
        f"| {rss[0]:.0f} → {rss[1]:.0f} |"
    )


async def run(args: argparse.Namespace, address: str, pid: int) -> int:
    from tether.client import AsyncRolloutClient

    clients = args.clients or (4 if args.quick else 16)
    seconds = args.seconds or (3.0 if args.quick else 20.0)
    async with AsyncRolloutClient(address, timeout_s=60) as warm:  # first-call costs out of the numbers
        await warm.generate(text="warm-up", n=1, max_tokens=args.max_tokens)
    print(
        f"server {address}: rollout.max_concurrent_requests={args.max_concurrent}, max_tokens={args.max_tokens}, "
        f"{seconds:g}s per phase\n"
    )
    print("| phase | clients | calls | p50 ms | p99 ms | ok/s | error rate | errors by code | server RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    phases = [
        ("generate", generate_loop, clients),
        ("episode", episode_loop, clients),
        ("backpressure", generate_loop, 4 * args.max_concurrent),
    ]
    refused, refusal_ms = 0, []
    goodput, growth, refusal_ratio = [], [], []
    for k in range(max(3, args.repeats)):
        seen: dict[str, tuple[Tally, float, tuple[float, float]]] = {}
        for name, fn, n in ordered(phases, k):
            before = rss_mib(pid)
            tally, elapsed = await phase(address, fn, n, seconds, args.max_tokens)
            seen[name] = (tally, elapsed, (before, rss_mib(pid)))
            print(row(name, n, tally, elapsed, seen[name][2]), flush=True)
        gen, over = seen["generate"], seen["backpressure"]
        refused += over[0].codes["RESOURCE_EXHAUSTED"]
        waits = sorted(over[0].refusals)
        p50 = waits[len(waits) // 2] if waits else float("nan")
        refusal_ms.append(p50 * 1e3)
        goodput.append((over[0].codes["OK"] / over[1]) / (gen[0].codes["OK"] / gen[1]))
        growth.append(over[2][1] / over[2][0])
        refusal_ratio.append(p50 / gen[0].quantile(0.5))
    print(
        f"\nbackpressure: RESOURCE_EXHAUSTED={refused} with {4 * args.max_concurrent} clients over a limit of "
        f"{args.max_concurrent}, answered in {statistics.median(refusal_ms):.1f} ms (p50, median of repeats): "
        "refused at once instead of queued\n"
    )
    within = f"the same server within its limit ({clients} clients, max_concurrent_requests {args.max_concurrent})"
    figures = [
        figure("load/backpressure_goodput", goodput, goal=0.8, direction="min",
               baseline=f"Generate calls/s of {within}; overload = {4 * args.max_concurrent} clients"),
        figure("load/backpressure_rss_growth", growth, goal=1.1, direction="max",
               baseline="the server's RSS before the overload phase"),
        figure("load/refusal_vs_call_latency", refusal_ratio, goal=0.5, direction="max",
               baseline=f"p50 latency of a served Generate of {within}"),
    ]  # fmt: skip
    for f in figures:
        report(f, quick=args.quick)
    return 0


def main() -> int:
    args = parse()
    from rollout_server.launch import spawn_server
    from tether.commands.tiny_model import make_tiny_model
    from tether.redis_server import EmbeddedRedis, free_port

    with tempfile.TemporaryDirectory(prefix="tether-load-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden=128, layers=2, heads=4, seed=0)
        with EmbeddedRedis(Path(tmp) / "redis") as redis_url:
            server = spawn_server(
                [
                    *("--model.path", str(model), "--run.run_id", f"load-{uuid.uuid4().hex[:8]}"),
                    *("--run.output_dir", str(Path(tmp) / "runs"), "--buffer.redis_url", redis_url),
                    *("--rollout.prompt_workers", "0", "--rollout.max_tokens", str(args.max_tokens)),
                    *("--rollout.max_concurrent_requests", str(args.max_concurrent)),
                    *("--buffer.max_trajectory_groups", "1000000"),  # nobody consumes: let episodes land
                ],
                port=free_port(),
                log_path=Path(tmp) / "server.log",
            )
            try:
                return asyncio.run(run(args, server.address, server.proc.pid))
            finally:
                server.terminate()


if __name__ == "__main__":
    sys.exit(main())
