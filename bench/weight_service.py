"""The ``store`` weight service over rate-limited links: an update against one raw broadcast, the learner's
publish time with 1–8 servers pulling, a server joining at version 100, and the bytes of each update.

    sudo python bench/weight_service.py [--quick] [--repeats N] [--links 1gbit,10gbit] [--lrs 1e-6,1e-5]
                                        [--parts ratio,scale,join] [--no-push] [--keep DIR] [--out FILE]

Hosts are network namespaces on one bridge (:mod:`bench.netns_links`), every port limited to the link rate
each way by tbf: ``redis`` (a redis-server), ``learner`` (this script's inner half: the models, AdamW, one
:class:`~weight_sync.store_publisher.StorePublisher` per fleet wired to Redis as ``learner/publish_schedule.py`` wires
it, the raw-broadcast root) and ``s0``..``s7`` (real ``python -m rollout_server`` processes: transformers
engine, ``model.dtype: bfloat16``, ``weight_sync.transport.type: store``, fanout 2). An update is
``StorePublisher.publish(v)`` — synchronous: it returns once every live server has recorded v in Redis — of
the weights after one real learner step (AdamW on a batch of random tokens; float32 master weights,
published as bfloat16 deltas). Every timing is taken on the learner.

1. **ratio** (the 101M-parameter Qwen2-style model of ``bench/weight_sync.py``; 1 server on ``s0``): per
   lr and link rate, rounds of one step then [update, raw] in alternating order, where raw is one gloo
   ``dist.broadcast`` of one flat buffer of the full bf16 bytes to a peer process on ``s0``, ended by a
   barrier. ``update_vs_raw_<rate>_lr<lr>`` = raw s / update s. After each round (untimed) a reader on the
   learner host decodes the same version from the store, which splits the server's fetch (the wire and the
   decode interleave there) into its two parts.
2. **scale** (a 24M-parameter model, so that 15 servers fit in memory; lr 1e-6): fleets of 1, 2, 4 and 8
   servers, each its own run id (so each sender waits on its own fleet; fleet N's servers on
   ``s0``..``s<N-1>``); each round, one step then a publication to every fleet in rotating order.
   ``publish_<N>_over_1``: the learner's publish time (``weight_sync/publish_seconds`` = stage + encode +
   write + announce: what the learner's step is charged) with N servers over 1, same round; likewise the
   whole update (``update_<N>_over_1``) and the origin's bytes out (``origin_bytes_<N>_over_1``). Then
   today's push beside it (``--push-servers``, default 1 and 8): a ``WeightSender`` over gloo to N rollout
   servers of ``transport.type: gloo`` (float32 master weights, as they travel today), alternating with the
   store update to the fleet of the same N after the same step: ``push_vs_store_update_<N>srv``.
3. **join** (the ratio model, ``base_every`` 20): versions 0..100 published with a cheap perturbation
   (every weight moved by 1e-6 in a random direction) and no server; a new server process on ``s1`` is timed
   from its start to its Redis record of v100, alternating with a raw broadcast of the full bytes; then 10
   real steps and the same at v110 (the v100 base and 10 deltas). Figures against the plan's bytes at the
   link rate (modelled) and against the raw broadcast (measured); the log's timestamps split the join into
   start-up, engine load, fetch and swap.
4. ``delta_bytes_vs_full_lr<lr>``: each timed update's stored bytes ÷ the full bf16 bytes (ratio part).

Round 0 (and 1 in the scale part) is warm-up: connections, the servers' second buffers touched once.
Figures are medians over ``--repeats`` rounds with the min–max (``bench/common.py``). Root only; prints
why and exits 2 otherwise. Timings are never asserted (``tests/integration/test_weight_service_bench.py``
runs ``--quick``: tiny models, one link, fleets of 1 and 2, push to 2, joins at v20 and v30).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import figure, ordered, report
from bench.netns_links import Links, can_run, rate_bits

HOSTS = ["redis", "learner", *(f"s{k}" for k in range(8))]
REDIS_PORT, GLOO_PORT, SERVER_PORT, ORIGIN_PORT = 6379, 29650, 50051, 7100
RAW, STOP = 0, -1  # what the raw root broadcasts to its peers first
MODELS = {  # make_tiny_model kwargs (vocabulary: 259 byte-level tokens)
    "main": {"hidden": 768, "layers": 16, "heads": 12, "kv_heads": 4, "intermediate": 2048},  # 101M
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 1536},  # 24M
    "quick": {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256},
}
ENV = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "TETHER_AUTH_TOKEN": "", "GRPC_VERBOSITY": "ERROR"}
NAN = float("nan")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else NAN


def rng(xs: list[float]) -> str:
    return f"{med(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})" if xs else "—"


class Learner:
    """A float32 model and AdamW: ``step(lr)`` is one real learner step on a batch of random tokens."""

    def __init__(self, model_dir: Path, *, seed: int = 0, batch: tuple[int, int] = (2, 64)) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.batch, self.gen = batch, torch.Generator().manual_seed(seed)
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self, lr: float) -> float:
        import torch

        start = time.perf_counter()
        for group in self.opt.param_groups:
            group["lr"] = lr
        ids = torch.randint(0, self.model.config.vocab_size, self.batch, generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def perturb(self, lr: float) -> None:
        """A cheap stand-in for a step: every weight moves by ``lr`` in a random direction."""
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen).sign_(), alpha=lr)


class RawWorld:
    """Rank 0 of a gloo world with a peer process per host; ``round()`` times one broadcast of ``nbytes``."""

    def __init__(self, lab: Links, hosts: list[str], nbytes: int, logs: Path) -> None:
        import torch
        import torch.distributed as dist

        init = f"tcp://{lab.ip['learner']}:{GLOO_PORT}"
        world = len(hosts) + 1
        self.peers = [
            lab.run(h, [sys.executable, __file__, "--peer", init, str(r + 1), str(world), str(nbytes)],
                    log=logs / f"raw-peer-{h}.log", env=ENV)
            for r, h in enumerate(hosts)
        ]  # fmt: skip
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=world)
        self.flat = torch.zeros(nbytes, dtype=torch.uint8)  # the full bf16 bytes as one buffer (gloo has no int16)

    def round(self) -> float:
        import torch
        import torch.distributed as dist

        dist.broadcast(torch.tensor([RAW], dtype=torch.int64), src=0)  # before the clock starts
        start = time.perf_counter()
        dist.broadcast(self.flat, src=0)
        dist.barrier()  # ends when every peer holds the bytes, as an update ends at the servers' records
        return time.perf_counter() - start

    def close(self) -> None:
        import torch
        import torch.distributed as dist

        dist.broadcast(torch.tensor([STOP], dtype=torch.int64), src=0)
        dist.destroy_process_group()
        for p in self.peers:
            p.wait(60)


def peer(init: str, rank: int, world: int, nbytes: int) -> int:
    """A raw-broadcast receiver: one flat buffer of the full bytes, reused, until told to stop."""
    import torch
    import torch.distributed as dist

    flat = torch.zeros(nbytes, dtype=torch.uint8)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    command = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.broadcast(command, src=0)
        if int(command) == STOP:
            break
        dist.broadcast(flat, src=0)
        dist.barrier()
    dist.destroy_process_group()
    return 0


class Fleet:
    """Rollout server processes under one run id, and the learner's sender to them: ``kind="store"``, a
    :class:`StorePublisher` with the learner's Redis callbacks; ``kind="push"``, a gloo ``WeightSender``."""

    def __init__(self, lab: Links, work: Path, name: str, *, model_dir: Path, learner: Learner, port: int,
                 server_port: int = SERVER_PORT, kind: str = "store", base_every: int = 10) -> None:  # fmt: skip
        import redis
        import yaml

        from buffer import RedisKeys, ServerRegistry

        self.lab, self.work, self.name, self.kind, self.learner = lab, work, name, kind, learner
        ip = lab.ip["learner"]
        transport = (
            {
                "type": "store",
                "host": ip,
                "port": port,
                "fanout": 2,
                "path": str(work / "store" / name),
                "base_every": base_every,
            }
            if kind == "store"
            else {"type": "gloo", "master_addr": ip, "master_port": port}
        )
        self.raw_cfg = {
            "run": {"run_id": name, "output_dir": str(work / "runs"), "log_format": "json"},
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "buffer": {"redis_url": f"redis://{lab.ip['redis']}:{REDIS_PORT}/0"},
            "rollout": {"engine": {"type": "transformers"}, "prompt_workers": 0, "heartbeat_s": 1.0},
            "weight_sync": {"transport": transport, "publish_dtype": "bfloat16", "snapshot_every": 0,
                            "prepare_timeout_s": 120, "transfer_timeout_s": 600, "commit_timeout_s": 300},
        }  # fmt: skip
        self.config = work / f"{name}.yaml"
        self.config.write_text(yaml.safe_dump(self.raw_cfg))
        self.procs: dict = {}
        self.addresses: dict[str, str] = {}
        self.started: dict[str, tuple[float, float]] = {}  # (monotonic, wall clock)
        self.server_port, self.launched = server_port, 0
        self.sender = None
        self.client = redis.Redis(host=lab.ip["redis"], port=REDIS_PORT)
        self.keys = RedisKeys(name)
        self.registry = ServerRegistry(self.client, self.keys)

    def start(self, host: str, tag: str = "") -> str:
        sid = f"{self.name}-{host}{tag}"
        port = self.server_port + self.launched  # hosts run a server of several fleets: a port each
        self.launched += 1
        self.addresses[sid] = f"{self.lab.ip[host]}:{port}"
        self.started[sid] = (time.monotonic(), time.time())
        argv = [sys.executable, "-m", "rollout_server", "--config", str(self.config), "--rollout.host",
                self.lab.ip[host], "--rollout.port", str(port), "--rollout.server_id", sid]  # fmt: skip
        self.procs[sid] = self.lab.run(host, argv, log=self.log_path(sid), env=ENV)
        return sid

    def log_path(self, sid: str) -> Path:
        return self.work / "logs" / f"{sid}.log"

    def stop(self, sid: str) -> None:
        self.lab.stop(self.procs.pop(sid))

    def check_alive(self, sid: str) -> None:
        proc = self.procs[sid]
        if proc.poll() is not None:
            raise RuntimeError(f"{sid} exited {proc.returncode}: {self.log_path(sid).read_text()[-3000:]}")

    def wait_live(self, timeout_s: float = 600) -> None:
        """Until every server started is in the registry (a publication waits on the live ones only)."""
        deadline = time.monotonic() + timeout_s
        while not set(self.procs) <= {s.server_id for s in self.registry.live()}:
            for sid in self.procs:
                self.check_alive(sid)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: servers not live after {timeout_s:.0f} s")
            time.sleep(0.2)

    def held(self, sid: str) -> int:
        from buffer.weights import held_versions

        return held_versions(self.client, self.keys, [sid])[sid].version

    def make_sender(self) -> None:
        from tether.config import TetherConfig

        cfg = TetherConfig.model_validate(self.raw_cfg)
        if self.kind == "push":
            from weight_sync.sender import WeightSender

            self.sender = WeightSender(cfg, model=self.learner.model, servers=list(self.addresses.values()))
            return
        from buffer.weights import announce_weights, held_versions
        from weight_sync.store_publisher import StorePublisher

        def fleet() -> dict[str, int]:  # as learner/publish_schedule.py: the live servers and what each holds
            live = [s.server_id for s in self.registry.live()]
            return {sid: h.version for sid, h in held_versions(self.client, self.keys, live).items()}

        def announce(info: dict) -> None:
            announce_weights(self.client, self.keys, info)

        self.sender = StorePublisher(cfg, model=self.learner.model, announce=announce, fleet=fleet)

    def publish(self, version: int, *, snapshot: bool = False) -> dict[str, float]:
        origin = getattr(self.sender, "origin", None)
        before = origin.bytes_out() if origin is not None else 0
        m = dict(self.sender.publish(version, snapshot=snapshot))  # type: ignore[union-attr]
        if self.procs and m.get("weight_sync/reached") != len(self.procs):
            raise RuntimeError(f"{self.name} v{version}: reached {m.get('weight_sync/reached')} of "
                               f"{len(self.procs)}: {self.sender.last_dropped}")  # type: ignore[union-attr]  # fmt: skip
        if origin is not None:
            m["origin_bytes"] = origin.bytes_out() - before
        return m

    def events(self, sid: str) -> list[dict]:
        """The server's JSON log records (``run.log_format: json``; tqdm bars share some lines)."""
        path, out = self.log_path(sid), []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if "{" in line:
                try:
                    out.append(json.loads(line[line.index("{") :]))
                except json.JSONDecodeError:
                    continue
        return out

    def pulls(self, sid: str) -> dict[int, dict]:
        return {int(r["version"]): r for r in self.events(sid) if r.get("event") == "weights_pulled"}

    def pull_times(self, version: int, timeout_s: float = 10.0) -> tuple[float, float]:
        """The slowest server's (fetch_s, swap_s) of ``version`` from the logs (a server logs its pull just
        after recording it in Redis, so the line may land a moment after the learner saw the record)."""
        deadline = time.monotonic() + timeout_s
        while True:
            recs = [self.pulls(sid).get(version) for sid in self.procs]
            if all(recs) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return max((r or {}).get("fetch_s", NAN) for r in recs), max((r or {}).get("swap_s", NAN) for r in recs)

    def close(self) -> None:
        for sid in list(self.procs):
            self.stop(sid)
        if self.sender is not None:
            self.sender.close()
        self.client.close()


def start_redis(lab: Links, work: Path) -> None:
    import redis

    from tether.redis_server import redis_executable

    (work / "redis").mkdir(parents=True, exist_ok=True)
    argv = [redis_executable(), "--port", str(REDIS_PORT), "--bind", lab.ip["redis"], "--dir", str(work / "redis"),
            "--save", "", "--appendonly", "no", "--protected-mode", "no"]  # fmt: skip
    lab.run("redis", argv, log=work / "logs" / "redis.log")
    client = redis.Redis(host=lab.ip["redis"], port=REDIS_PORT, socket_timeout=1)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# -- the parts ------------------------------------------------------------------------------------------
def part_ratio(lab: Links, work: Path, args: argparse.Namespace, learner: Learner, model_dir: Path,
               raw: RawWorld, results: dict) -> None:  # fmt: skip
    """An update to 1 server against one raw broadcast, per lr and link rate."""
    fleet = Fleet(lab, work, "ratio", model_dir=model_dir, learner=learner, port=ORIGIN_PORT)
    try:
        fleet.start("s0")
        fleet.wait_live()
        fleet.make_sender()
        lab.set_rate(args.links[0])
        version = 0
        fleet.publish(version, snapshot=True)
        store = fleet.sender.store  # type: ignore[union-attr]
        follower, spare = store.fetch(version), None  # the learner host's own reader (untimed)
        for lr in args.lrs:
            for rate in args.links:
                lab.set_rate(rate)
                rows = []
                for k in range(args.repeats + 1):
                    row = {"step_s": learner.step(lr)}
                    version += 1
                    for side in ordered(["update", "raw"], k):
                        if side == "raw":
                            row["raw"] = raw.round()
                        else:
                            row.update(fleet.publish(version))
                    row["fetch_s"], row["swap_s"] = fleet.pull_times(version)
                    t0 = time.perf_counter()
                    follower, spare = store.fetch(version, held=follower, reuse=spare), follower
                    row["decode_s"] = time.perf_counter() - t0
                    if k:  # round 0: warm-up (a new rate or lr)
                        rows.append(row)
                results["ratio"][f"{rate}/{lr:g}"] = rows
                print_ratio(rate, lr, rows)
    finally:
        fleet.close()


def print_ratio(rate: str, lr: float, rows: list[dict]) -> None:
    for r in rows:
        r["announce_s"] = r["weight_sync/publish_seconds"] - sum(
            r[f"weight_sync/{k}_seconds"] for k in ("stage", "encode", "write")
        )
    c = {k: med([r[k] for r in rows]) for k in rows[0]}
    col = {k: [r[k] for r in rows] for k in ("weight_sync/seconds", "raw", "weight_sync/delta_ratio")}
    stage, encode, write = (c[f"weight_sync/{k}_seconds"] for k in ("stage", "encode", "write"))
    print(f"\nratio, {rate}, lr {lr:g}: update {rng(col['weight_sync/seconds'])} s, raw {rng(col['raw'])} s, delta "
          f"{rng(col['weight_sync/delta_ratio'])} of {c['weight_sync/full_bytes'] / 1e6:.1f} MB bf16, learner step "
          f"{c['step_s']:.2f} s (untimed)\n  where the update's time goes (medians, s): stage {stage:.3f}, encode "
          f"{encode:.3f}, write {write:.3f}, announce {c['announce_s']:.3f}"
          f"; pull {c['weight_sync/pull_seconds']:.3f} = the server's fetch + decode {c['fetch_s']:.3f} (decode "
          f"alone ~{c['decode_s']:.3f} on the learner host) + swap {c['swap_s']:.3f} + Redis polling both sides",
          flush=True)  # fmt: skip


def part_scale(lab: Links, work: Path, args: argparse.Namespace, model_dir: Path, results: dict) -> None:
    """Store fleets of 1, 2, 4, 8 servers, one publication to each per round in rotating order; then push."""
    learner = Learner(model_dir, seed=1)
    results["what"]["small"] = f"{learner.params / 1e6:.1f}M params ({learner.params * 2 / 1e6:.0f} MB bf16), 2 cpus"
    print(f"\nmodel (scale): {results['what']['small']}", flush=True)
    lab.set_rate(args.scale_link)
    fleets = {n: Fleet(lab, work, f"n{n}", model_dir=model_dir, learner=learner, port=ORIGIN_PORT + 10 + n,
                       server_port=SERVER_PORT + 100 * n) for n in args.servers}  # fmt: skip
    try:
        for n, f in fleets.items():
            for k in range(n):
                f.start(f"s{k}")
        for f in fleets.values():
            f.wait_live()
            f.make_sender()
        rss = sum(_rss(p.pid) for f in fleets.values() for p in f.procs.values())
        print(f"\nscale: {sum(args.servers)} servers live, {rss / 2**30:.1f} GiB resident in all", flush=True)
        version = 0
        for f in fleets.values():
            f.publish(version, snapshot=True)
        rows = []
        for k in range(args.repeats + 2):
            learner.step(1e-6)
            version += 1
            row = {}
            for n in ordered(args.servers, k):
                row[str(n)] = fleets[n].publish(version)
            for n in args.servers:
                row[str(n)]["fetch_s"], row[str(n)]["swap_s"] = fleets[n].pull_times(version)
            if k >= 2:
                rows.append(row)
        results["scale"] = rows
        print(f"scale, {args.scale_link}, lr 1e-6, medians (min–max) over {len(rows)} rounds:\n| servers | publish "
              "s (learner) | update s | origin MB out per update | update MB | slowest fetch + decode s | swap s |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
        for n in args.servers:
            c = {key: [r[str(n)][key] for r in rows] for key in rows[0][str(n)]}
            print(f"| {n} | {rng(c['weight_sync/publish_seconds'])} | {rng(c['weight_sync/seconds'])} | "
                  f"{med(c['origin_bytes']) / 1e6:.2f} | {med(c['weight_sync/bytes']) / 1e6:.2f} | "
                  f"{med(c['fetch_s']):.3f} | {med(c['swap_s']):.3f} |", flush=True)  # fmt: skip
        if args.push:
            results["push"] = part_push(lab, work, args, learner, model_dir, fleets, version)
    finally:
        for f in fleets.values():
            f.close()


def part_push(lab: Links, work: Path, args: argparse.Namespace, learner: Learner, model_dir: Path,
              fleets: dict[int, Fleet], version: int) -> dict:  # fmt: skip
    """Per N: N rollout servers of the gloo transport and a WeightSender pushing to them, alternating with the
    store update to the fleet of N after the same step."""
    out = {}
    for n in args.push_servers:
        push = Fleet(lab, work, f"p{n}", model_dir=model_dir, learner=learner, port=GLOO_PORT + 10 + n,
                     server_port=SERVER_PORT + 2000 + 100 * n, kind="push")  # fmt: skip
        try:
            for k in range(n):
                push.start(f"s{k}")
            push.wait_live()
            push.make_sender()
            rows = []
            for k in range(args.repeats + 2):
                learner.step(1e-6)
                version += 1
                row = {side: (fleets[n] if side == "store" else push).publish(version)
                       for side in ordered(["store", "push"], k)}  # fmt: skip
                if k >= 2:
                    rows.append(row)
            out[str(n)] = rows
            p, s = ([r[side]["weight_sync/seconds"] for r in rows] for side in ("push", "store"))
            print(f"push vs store, {n} server(s), {args.scale_link}: push {rng(p)} s (float32, "
                  f"{rows[0]['push']['weight_sync/bytes'] / 1e6:.1f} MB), store update {rng(s)} s",
                  flush=True)  # fmt: skip
        finally:
            push.close()
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def part_join(lab: Links, work: Path, args: argparse.Namespace, learner: Learner, model_dir: Path,
              raw: RawWorld, results: dict) -> None:  # fmt: skip
    """Versions 0..join_at with no server, joins at join_at (a base); 10 real steps on, joins again."""
    lab.set_rate(args.join_link)
    fleet = Fleet(lab, work, "join", model_dir=model_dir, learner=learner, port=ORIGIN_PORT + 1, base_every=20)
    results["join"] = {}
    try:
        fleet.make_sender()
        start = time.perf_counter()
        for v in range(args.join_at + 1):
            if v:
                learner.perturb(1e-6)
            fleet.publish(v, snapshot=(v == 0))
        print(f"\njoin: v0..v{args.join_at} published with no server in {time.perf_counter() - start:.0f} s "
              "(a cheap perturbation per version)", flush=True)  # fmt: skip
        joins(fleet, args, raw, args.join_at, results["join"])
        for v in range(args.join_at + 1, args.join_at + 11):
            learner.step(1e-6)
            fleet.publish(v)
        joins(fleet, args, raw, args.join_at + 10, results["join"])
    finally:
        fleet.close()


def joins(fleet: Fleet, args: argparse.Namespace, raw: RawWorld, target: int, out: dict) -> None:
    """``--repeats`` new server processes on ``s1``, each from its start to its Redis record of ``target``,
    alternating with a raw broadcast of the full bytes."""
    plan = fleet.sender.store.plan(target)  # type: ignore[union-attr]
    plan_bytes = sum(m.stored_bytes for m in plan)
    common = {"link_s": plan_bytes * 8 / rate_bits(args.join_link), "chain": [f"v{m.version}.{m.kind}" for m in plan]}
    rows = []
    for k in range(args.repeats):
        row = dict(common)
        for side in ordered(["join", "raw"], k):
            if side == "raw":
                row["raw"] = raw.round()
                continue
            sid = fleet.start("s1", tag=f"-v{target}-{k}")
            while fleet.held(sid) < target:
                fleet.check_alive(sid)
                time.sleep(0.01)
            row["join"] = time.monotonic() - fleet.started[sid][0]
            fleet.pull_times(target)  # its log line is in
            row.update(startup(fleet, sid, target))
            fleet.stop(sid)
        rows.append(row)
    out[str(target)] = rows
    c = {key: [r[key] for r in rows] for key in ("join", "imports_s", "engine_s", "fetch_s", "swap_s", "raw")}
    print(f"join at v{target} ({common['chain'][0]} + {len(plan) - 1} deltas, {plan_bytes / 1e6:.1f} MB, "
          f"{args.join_link}): process start to serving {rng(c['join'])} s = start-up to the engine load "
          f"{rng(c['imports_s'])} + engine load {rng(c['engine_s'])} + fetch and decode {rng(c['fetch_s'])} + swap "
          f"{rng(c['swap_s'])} (+ Redis); the plan's bytes at link speed {common['link_s']:.3f} s; one raw broadcast "
          f"of the full bytes {rng(c['raw'])} s", flush=True)  # fmt: skip


def startup(fleet: Fleet, sid: str, target: int) -> dict:
    """A joining server's time from its log's timestamps: process start → ``engine_loading`` (imports,
    config) → ``engine_started`` (the model from disk) → its pull of ``target`` (fetch + decode, swap)."""
    when = {r["event"]: datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")).timestamp()
            for r in fleet.events(sid) if r.get("event") in ("engine_loading", "engine_started")}  # fmt: skip
    pull = fleet.pulls(sid).get(target, {})
    return {
        "imports_s": when.get("engine_loading", NAN) - fleet.started[sid][1],
        "engine_s": when.get("engine_started", NAN) - when.get("engine_loading", NAN),
        "fetch_s": pull.get("fetch_s", NAN),
        "swap_s": pull.get("swap_s", NAN),
        "bytes": pull.get("bytes", 0),
    }


# -- figures --------------------------------------------------------------------------------------------
def figures(results: dict, args: argparse.Namespace) -> list:
    big, small, out = results["what"]["main"], results["what"].get("small", ""), []

    def add(name: str, ratios: list[float], baseline: str, goal: float | None = None, direction: str = "min") -> None:
        out.append(figure(f"weight_service/{name}", ratios, goal=goal, direction=direction, baseline=baseline))  # type: ignore[arg-type]

    for key, rows in results.get("ratio", {}).items():
        rate, lr = key.split("/")
        add(f"update_vs_raw_{rate}_lr{lr}", [r["raw"] / r["weight_sync/seconds"] for r in rows],
            f"one raw gloo dist.broadcast of the full bf16 bytes (one flat buffer) to the server host over {rate} "
            f"links, to a barrier; the update: StorePublisher.publish after an AdamW step at lr {lr} until the rollout "
            f"server holds it; {big}", 3.0 if rate == "1gbit" and float(lr) == 1e-6 else None)  # fmt: skip
    for lr in args.lrs:
        ratios = [r["weight_sync/delta_ratio"] for key, rows in results.get("ratio", {}).items()
                  if float(key.split("/")[1]) == lr for r in rows]  # fmt: skip
        if ratios:
            add(f"delta_bytes_vs_full_lr{lr:g}", ratios, f"the full bf16 bytes of the same version, each timed update "
                f"after an AdamW step at lr {lr:g}; {big}", 0.05 if lr == 1e-6 else None, "max")  # fmt: skip
    rows = results.get("scale", [])
    for n in args.servers[1:] if rows else []:
        for key, name in (("weight_sync/publish_seconds", "publish"), ("weight_sync/seconds", "update"),
                          ("origin_bytes", "origin_bytes")):  # fmt: skip
            add(f"{name}_{n}_over_1", [r[str(n)][key] / r["1"][key] for r in rows],
                f"the same with 1 server in the same round (fleets of {'/'.join(map(str, args.servers))} in rotating "
                f"order), {args.scale_link}, fanout 2, AdamW lr 1e-6; {small}"
                + ("; publish = stage + encode + write + announce" if name == "publish" else ""),
                1.2 if (name == "publish" and n == 8) else None, "max")  # fmt: skip
    for n, rows in results.get("push", {}).items():
        add(f"push_vs_store_update_{n}srv", [r["push"]["weight_sync/seconds"] / r["store"]["weight_sync/seconds"]
                                             for r in rows],
            f"push s / store update s (> 1: the store is faster): today's WeightSender over gloo, float32 master "
            f"weights, to {n} rollout server(s) of transport gloo, vs the store update to {n} after the same step, "
            f"{args.scale_link}; {small}")  # fmt: skip
    for target, rows in results.get("join", {}).items():
        what = f"{rows[0]['chain'][0]} + {len(rows[0]['chain']) - 1} deltas at {args.join_link}"
        add(f"join_v{target}_vs_link", [r["link_s"] / r["join"] for r in rows],
            f"the plan's bytes ({what}, modelled) against a new server's process start to its Redis record of "
            f"v{target}; {big}")  # fmt: skip
        add(f"join_v{target}_pull_vs_link", [r["link_s"] / (r["fetch_s"] + r["swap_s"]) for r in rows],
            f"the plan's bytes ({what}, modelled) against the joining server's fetch + decode + swap of v{target} "
            f"(its log); {big}")  # fmt: skip
        add(f"join_v{target}_pull_vs_raw", [r["raw"] / (r["fetch_s"] + r["swap_s"]) for r in rows],
            f"one raw gloo broadcast of the full bf16 bytes over {args.join_link} against the joining server's "
            f"fetch + decode + swap of v{target}; {big}")  # fmt: skip
    return out


# -- entry points ---------------------------------------------------------------------------------------
def inner(args: argparse.Namespace) -> int:
    """Inside the learner host: Redis, the parts, the figures."""
    import torch

    from tether.commands.tiny_model import make_tiny_model

    os.environ.update(ENV)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    lab = Links.attach(args.inner)
    work = lab.folder.parent
    (work / "logs").mkdir(parents=True, exist_ok=True)
    start_redis(lab, work)
    results: dict = {"ratio": {}, "what": {}}
    main_dir = make_tiny_model(work / "model-main", seed=0, **MODELS["quick" if args.quick else "main"])
    learner = Learner(main_dir)
    results["what"]["main"] = f"{learner.params / 1e6:.1f}M params ({learner.params * 2 / 1e6:.0f} MB bf16), 2 cpus"
    print(f"model (ratio, join): {results['what']['main']}; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)  # fmt: skip
    raw = RawWorld(lab, ["s0"], learner.params * 2, work / "logs") if {"ratio", "join"} & set(args.parts) else None
    try:
        if "ratio" in args.parts:
            part_ratio(lab, work, args, learner, main_dir, raw, results)  # type: ignore[arg-type]
        if "scale" in args.parts:
            small_dir = make_tiny_model(work / "model-small", seed=1, **MODELS["quick" if args.quick else "small"])
            part_scale(lab, work, args, small_dir, results)
        if "join" in args.parts:
            part_join(lab, work, args, learner, main_dir, raw, results)  # type: ignore[arg-type]
    finally:
        if raw is not None:
            raw.close()
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end", flush=True)
    for f in figures(results, args):
        report(f, quick=args.quick)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny models, 3 repeats, 1 Gbit/s, join at v20 (smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, quick 3; >= 3)")
    p.add_argument("--links", default="1gbit,10gbit", help="link rates of the ratio part (tc syntax)")
    p.add_argument("--lrs", default="1e-6,1e-5", help="AdamW learning rates of the ratio part")
    p.add_argument("--servers", default=None, help="fleet sizes of the scale part, the first the baseline "
                   "(default 1,2,4,8; quick 1,2)")  # fmt: skip
    p.add_argument("--push-servers", default=None, help="fleet sizes today's push runs beside (default 1,8; quick 2)")
    p.add_argument("--no-push", dest="push", action="store_false", help="leave today's push out")
    p.add_argument("--scale-link", default="1gbit")
    p.add_argument("--join-link", default="1gbit")
    p.add_argument("--join-at", type=int, default=None, help="the version a new server joins at (default 100)")
    p.add_argument("--parts", default="ratio,scale,join")
    p.add_argument("--out", default=None, help="write every round's numbers here (JSON)")
    p.add_argument("--keep", default=None, help="work folder to keep (logs, stores); default: a temporary one")
    p.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer", nargs=4, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        init, rank, world, nbytes = args.peer
        return peer(init, int(rank), int(world), int(nbytes))
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 3:
        p.error("--repeats must be at least 3 (a figure is a median with its spread)")
    args.links = ["1gbit"] if args.quick else [x for x in args.links.split(",") if x]
    args.lrs = [float(x) for x in args.lrs.split(",") if x]
    args.servers = [int(x) for x in (args.servers or ("1,2" if args.quick else "1,2,4,8")).split(",") if x]
    args.push_servers = [int(x) for x in (args.push_servers or ("2" if args.quick else "1,8")).split(",") if x]
    args.join_at = args.join_at or (20 if args.quick else 100)
    args.parts = [x for x in args.parts.split(",") if x]
    if args.inner:
        return inner(args)
    reason = can_run()
    if reason:
        print(f"bench/weight_service.py: cannot build the hosts here ({reason})")
        return 2
    with tempfile.TemporaryDirectory(prefix="tether-bench-ws-svc-") as tmp:
        work = Path(args.keep or tmp)
        with Links(HOSTS, folder=work / "lab") as lab:
            child = [sys.executable, __file__, "--inner", lab.describe(), *(sys.argv[1:] if argv is None else argv)]
            return lab.run("learner", child).wait()


if __name__ == "__main__":
    raise SystemExit(main())
