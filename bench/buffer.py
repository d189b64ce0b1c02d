"""Buffer throughput against raw Redis commands on the same bytes, measured in the same run.

    python bench/buffer.py [--quick] [--redis-url URL] [--compression none|zlib]

For groups of G=8 completions of 1K, 4K and 16K tokens (int32 ids, float32 log-probs, int32 versions,
uint8 masks, the sampling temperature and timestamps — what a rollout server writes, built by its own
``rollout_server.trajectories.build_trajectory``), it times put → read → ack through ``buffer`` (including
the columnar encode and decode) and then XADD / XREADGROUP / XACK of the already-encoded bytes with plain
redis-py, in the same pattern: a learner batch of 8 groups is put, read in one call and acknowledged in
one call. Each size runs twice: the 8 puts one by one against one XADD per group, then the 8 in one
``put_many`` (what a rollout server can send for groups that finish together) against the 8 XADDs in one
redis-py pipeline (what a user with 8 groups in hand would write), so batching is credited to neither
side alone. It prints groups/s, MB/s, the ratio buffer/raw (goal ≥ 0.8), the
serialization cost per group and the ``codec ceiling``: raw's time per group over raw's time plus one
encode and one decode, the ratio the buffer would reach if every Redis command of its own cost nothing
more than raw's — what the goal leaves for the codec. Beside each wall-clock figure goes its ``_cpu`` twin:
the CPU seconds both sides cost (this process's plus the Redis server's, from ``INFO cpu``), raw's over the
buffer's. On a 2-core machine that ratio bounds what any arrangement of round trips could reach, and unlike
wall time it does not move with how long an idle core takes to wake up (on the 2-vCPU VM this project is
measured on, a loopback round trip between the two cores costs 160–400 µs, ~40 µs within one). Without
``--redis-url`` it starts an embedded redis-server.

The baseline is what a user without tether would write: the same stream commands on bytes already
encoded, so the ratio charges tether for its encode/decode, its idempotency key, its group-atomic
insert and its counters. Each repeat times both paths back to back, the order alternating from repeat
to repeat; the figure ``buffer/<tokens>`` is the median of the per-repeat ratios with their min–max
(``bench/common.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from a checkout

from bench.common import figure, ordered, report
from buffer import RedisKeys, TrajectoryReader, TrajectoryWriter, encode_payload
from buffer.codec import decode_payload
from rollout_server.trajectories import build_trajectory
from tether.config.buffer import BufferConfig
from tether.redis_server import EmbeddedRedis, connect_redis
from tether.trajectory import LOGPROB_PROCESSED, GroupData
from tether.v1.trajectory_pb2 import FINISH_REASON_STOP

G = 8
BATCH = 8
PROMPT_TOKENS = 256
VOCAB = 151_936


def make_group(tokens: int, rng: np.random.Generator, *, version: int = 3) -> GroupData:
    """A group as a rollout server writes it: built by its own trajectory builder (sampling temperature in
    the metadata, start and finish times), group metadata as the prompt worker sets it."""
    trajs = []
    gid = uuid.uuid4().hex
    for i in range(G):
        versions = np.full(tokens, version, dtype=np.int32)
        versions[: tokens // 3] = version - 1  # a weight update landed mid-generation
        mask = np.ones(tokens, dtype=np.uint8)
        mask[tokens // 2 : tokens // 2 + tokens // 16] = 0  # an environment turn inside the completion
        trajs.append(
            build_trajectory(
                trajectory_id=f"{gid}-{i}",
                group_id=gid,
                prompt_ids=rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32),
                token_ids=rng.integers(0, VOCAB, tokens, dtype=np.int32),
                logprobs=np.log(rng.random(tokens, dtype=np.float32) + 1e-6),
                versions=versions,
                loss_mask=mask,
                finish_reason=FINISH_REASON_STOP,
                server_id="rollout-0",
                logprob_source=LOGPROB_PROCESSED,
                temperature=1.0,
                started_at=time.time(),
                reward=float(rng.random()),
            )
        )
    return GroupData(group_id=gid, trajectories=trajs, prompt_id="0-1",
                     metadata={"dataset_index": "0", "issued_at_version": str(version)})  # fmt: skip


def time_serialization(group: GroupData, cfg: BufferConfig, reps: int) -> tuple[float, float, int]:
    """(encode µs, decode µs, payload bytes) per group, median of ``reps``."""
    enc, dec = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        codec, payload = encode_payload(
            group, compression=cfg.compression, compress_min_bytes=cfg.compress_min_bytes, level=cfg.compress_level
        )
        t1 = time.perf_counter()
        decode_payload(codec, payload)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return statistics.median(enc) * 1e6, statistics.median(dec) * 1e6, len(payload)


def redis_cpu_s(client) -> float:
    """CPU seconds the Redis server process has used so far (user + system, all its threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Timed:
    """Wall seconds of one timed path, and the CPU seconds this process and the Redis server spent on it."""

    def __init__(self, client) -> None:
        self.client = client

    def __enter__(self) -> Timed:
        self._redis, self._cpu, self._wall = redis_cpu_s(self.client), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu + redis_cpu_s(self.client) - self._redis


def run_buffer(client, groups: list[GroupData], cfg: BufferConfig, *, batched: bool) -> Timed:
    keys = RedisKeys(f"bench-{uuid.uuid4().hex[:8]}")
    writer = TrajectoryWriter(client, keys, cfg)
    reader = TrajectoryReader(client, keys, cfg, consumer="bench")
    with Timed(client) as timed:
        for start in range(0, len(groups), BATCH):
            batch = groups[start : start + BATCH]
            if batched:
                writer.put_many(batch)
            else:
                for g in batch:
                    writer.put(g)
            got = reader.read(len(batch), current_version=3, max_staleness=4, block_ms=1000)
            assert len(got) == len(batch), f"read {len(got)} of {len(batch)}"
            reader.ack([b.entry_id for b in got])
    client.delete(*[keys.trajectories, keys.counters, keys.staleness])
    for g in groups:
        client.delete(keys.seen(g.group_id))
    return timed


def run_raw(client, payloads: list[bytes], *, batched: bool) -> Timed:
    stream = f"bench-raw-{uuid.uuid4().hex[:8]}"
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    with Timed(client) as timed:
        for start in range(0, len(payloads), BATCH):
            batch = payloads[start : start + BATCH]
            if batched:  # what a user with several groups in hand writes: one pipelined round trip
                pipe = client.pipeline(transaction=False)
                for p in batch:
                    pipe.xadd(stream, {"d": p})
                pipe.execute()
            else:
                for p in batch:
                    client.xadd(stream, {"d": p})
            got = client.xreadgroup("g", "bench", {stream: ">"}, count=len(batch), block=1000)
            ids = [i for i, _ in got[0][1]]
            assert len(ids) == len(batch)
            client.xack(stream, "g", *ids)
    client.delete(stream)
    return timed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few groups per size: a smoke run, not a measurement")
    ap.add_argument("--redis-url", default="", help="benchmark this Redis (default: start an embedded one)")
    ap.add_argument("--compression", choices=["none", "zlib"], default="none", help="buffer.compression to measure")
    ap.add_argument("--repeats", type=int, default=0, help="timed repeats per size (default 3; median reported)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384], help="completion lengths to run")
    args = ap.parse_args(argv)

    sizes = args.tokens
    budget = 8 * 2**20 if args.quick else 192 * 2**20  # payload bytes per size and path
    repeats = args.repeats or (3 if args.quick else 5)
    cfg = BufferConfig(compression=args.compression, max_trajectory_groups=10**6, max_trajectory_bytes=2**40)
    rng = np.random.default_rng(0)

    with tempfile.TemporaryDirectory() as tmp:
        embedded = None if args.redis_url else EmbeddedRedis(tmp)
        url = args.redis_url or embedded.start()
        try:
            client = connect_redis(url)
            version = client.info("server")["redis_version"]
            print(f"redis {version}, G={G}, batch {BATCH} groups, compression {args.compression}, repeats {repeats}")
            header = (
                f"{'tokens':>6} {'puts':>26} {'MB/group':>8} {'buffer g/s':>10} {'raw g/s':>9} {'buffer MB/s':>11} "
                f"{'raw MB/s':>9} {'ratio':>6} {'encode µs':>10} {'decode µs':>10} {'codec ceiling':>13} "
                f"{'buffer CPU µs':>13} {'raw CPU µs':>10}"
            )
            print(header)
            print("-" * len(header))
            figures = []
            for tokens in sizes:
                template = make_group(tokens, rng)
                enc_us, dec_us, nbytes = time_serialization(template, cfg, reps=3 if args.quick else 10)
                # Up to 1024 groups (192 MiB) per timed path: with 256, a 1K-token path took ~80 ms and the
                # VM's jitter moved a repeat's ratio by ±0.2; at 1024 two runs agree within ~0.02.
                n = max(BATCH, min(1024, budget // nbytes) // BATCH * BATCH)
                groups = [make_group(tokens, rng) for _ in range(n)]
                payloads = [
                    encode_payload(
                        g,
                        compression=args.compression,
                        compress_min_bytes=cfg.compress_min_bytes,
                        level=cfg.compress_level,
                    )[1]
                    for g in groups
                ]
                raw_bytes = sum(len(p) for p in payloads)
                for batched in (False, True):
                    buf_s, raw_s = [], []
                    for k in range(repeats):  # back to back, order alternating: drift hits both paths alike
                        for g in groups:  # fresh ids: a re-put of a known group id is (rightly) a no-op
                            g.group_id = uuid.uuid4().hex
                            for t in g.trajectories:
                                t.group_id = g.group_id
                        for side in ordered(["raw", "buffer"], k):
                            if side == "raw":
                                raw_s.append(run_raw(client, payloads, batched=batched))
                            else:
                                buf_s.append(run_buffer(client, groups, cfg, batched=batched))
                    buf_wall, raw_wall = [t.wall for t in buf_s], [t.wall for t in raw_s]
                    buf_cpu, raw_cpu = [t.cpu for t in buf_s], [t.cpu for t in raw_s]
                    b, r = statistics.median(buf_wall), statistics.median(raw_wall)
                    raw_us = r / n * 1e6
                    how = "put_many + pipelined XADDs" if batched else "one put / XADD per group"
                    name = f"buffer/{tokens // 1024}K_tokens" + ("_put_many" if batched else "")
                    baseline = (
                        "raw XADD/XREADGROUP/XACK of the same encoded bytes (redis-py), "
                        + ("the batch's 8 XADDs in one pipeline" if batched else "one XADD per group")
                        + f", G={G}, acks on"
                    )
                    figures.append(
                        figure(
                            name,
                            [rs / bs for rs, bs in zip(raw_wall, buf_wall, strict=True)],
                            goal=0.8,
                            direction="min",
                            baseline=baseline,
                        )
                    )
                    figures.append(
                        figure(
                            f"{name}_cpu",
                            [rs / bs for rs, bs in zip(raw_cpu, buf_cpu, strict=True)],
                            goal=None,
                            direction="min",
                            baseline=f"the CPU seconds (client + Redis) of {baseline}",
                        )
                    )
                    print(
                        f"{tokens:>6} {how:>26} {nbytes / 2**20:>8.2f} {n / b:>10.1f} {n / r:>9.1f} "
                        f"{raw_bytes / 2**20 / b:>11.1f} {raw_bytes / 2**20 / r:>9.1f} {r / b:>6.2f} {enc_us:>10.0f} "
                        f"{dec_us:>10.0f} {raw_us / (raw_us + enc_us + dec_us):>13.2f} "
                        f"{statistics.median(buf_cpu) / n * 1e6:>13.0f} {statistics.median(raw_cpu) / n * 1e6:>10.0f}"
                    )
            client.close()
        finally:
            if embedded is not None:
                embedded.stop()
    print("ratio = buffer throughput / raw XADD+XREADGROUP+XACK throughput on the same bytes (goal >= 0.8)")
    print("columns: medians over the repeats; figures: median of per-repeat ratios")
    for f in figures:
        report(f, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
