"""Scores/s of a reward model served over gRPC: batched by token budget vs one completion per forward.

    python bench/reward_model.py [--repeats 3] [--calls 6] [--group 8] [--hidden 256] [--layers 4] [--quick]

Two processes of ``examples/reward_model_service.py`` serve the same tiny sequence-classification model
(made locally): one batches every waiting completion by token budget, the baseline (``--no-batching``)
runs one forward per completion — what a reward service that loops over its requests does. 1 and then
16 concurrent clients each send ``--calls`` ScoreBatch calls of a group of ``--group`` completions (what a
rollout server sends per prompt), completion lengths drawn from 16–400 bytes. The figure per client
count is scores/s batched over scores/s one-at-a-time, the two measured back to back in alternating
order, median and min–max over ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report

REPO = Path(__file__).resolve().parents[1]
SERVICE = REPO / "examples" / "reward_model_service.py"


def start(model: Path, port: int, *, batching: bool, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(SERVICE), "--model", str(model), "--port", str(port), "--host", "127.0.0.1"]
    return subprocess.Popen([*cmd, *([] if batching else ["--no-batching"])], stdout=log.open("w"),
                            stderr=subprocess.STDOUT)  # fmt: skip


async def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"reward model service exited ({proc.returncode}) before serving")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.3)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f}s")


async def load(address: str, *, clients: int, calls: int, group: int, seed: int) -> float:
    """Scores per second over ``clients`` concurrent callers, each ``calls`` ScoreBatch calls of ``group``."""
    import grpc

    from tether.v1 import reward_pb2, reward_pb2_grpc

    rng = random.Random(seed)
    text = "The answer is 42 because six times seven is forty-two. " * 8

    def request() -> reward_pb2.ScoreBatchRequest:
        return reward_pb2.ScoreBatchRequest(requests=[
            reward_pb2.ScoreRequest(prompt="What is six times seven?", completion=text[: rng.randint(16, 400)])
            for _ in range(group)
        ])  # fmt: skip

    async def client(stub) -> int:
        scored = 0
        for _ in range(calls):
            reply = await stub.ScoreBatch(request(), timeout=300)
            scored += len(reply.responses)
        return scored

    async with grpc.aio.insecure_channel(address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        await stub.ScoreBatch(request(), timeout=300)  # warm-up: the first forward pays for lazy init
        t0 = time.perf_counter()
        scored = sum(await asyncio.gather(*(client(stub) for _ in range(clients))))
        return scored / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=6, help="ScoreBatch calls per client")
    p.add_argument("--group", type=int, default=8, help="completions per call (rollout.n)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, 2 calls (not a measurement)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.calls = 1, 2
    sys.path.insert(0, str(SERVICE.parent))
    from reward_model_service import make_tiny_reward_model

    from tether.redis_server import free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_reward_model(Path(tmp) / "rm", hidden=args.hidden, layers=args.layers)
        ports = {"batched": free_port(), "single": free_port()}
        procs = {m: start(model, ports[m], batching=m == "batched", log=Path(tmp) / f"{m}.log") for m in ports}
        try:
            for m, proc in procs.items():
                asyncio.run(wait_serving(f"127.0.0.1:{ports[m]}", proc))
            for clients in (1, 16):
                ratios = []
                for k in range(args.repeats):
                    rate = {}
                    for m in ordered(["batched", "single"], k):
                        rate[m] = asyncio.run(load(f"127.0.0.1:{ports[m]}", clients=clients, calls=args.calls,
                                                   group=args.group, seed=k))  # fmt: skip
                    ratios.append(rate["batched"] / rate["single"])
                    print(f"{clients} clients, repeat {k}: batched {rate['batched']:.1f} scores/s, one at a time "
                          f"{rate['single']:.1f} scores/s", flush=True)  # fmt: skip
                report(figure(f"reward_model/scores_per_s_batched_vs_single_{clients}_clients", ratios, goal=1.0,
                              direction="min", baseline="the same service and model, one completion per forward",
                              note=f"group {args.group}, {args.calls} calls per client, hidden {args.hidden}, "
                                   f"{args.layers} layers"), quick=args.quick)  # fmt: skip
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
