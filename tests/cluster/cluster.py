"""A tether run across separate hosts: Redis, a two-node learner, rollout hosts and a reward host.

Every process starts inside its own host with the commands ``docs/FLEETS.md`` gives users — ``redis-server
--appendonly yes --bind``, ``tether learner --nnodes 2 --node-rank i --rdzv-endpoint learner0:29500``,
``tether rollout --rollout.host <its address>``, the example reward service — and no test-only flag. The
only additions are what any multi-homed host needs and FLEETS.md now says: ``GLOO_SOCKET_IFNAME`` (gloo
picks its interface from the hostname otherwise, which names no address of these hosts) and one
intra-op thread per process (seven processes share two cores). The task is ``demo:addition`` scored by
the reward host's math reward, with a tiny model made at start; the run folder is shared by every host,
as FLEETS.md asks for snapshots.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.cluster.netlab import Lab
from tests.helpers import processes_mentioning
from tether.metrics import read_metrics
from tether.redis_server import redis_executable

HOSTS = {
    "redis": "198.18.0.2",
    "learner0": "198.18.0.10",
    "learner1": "198.18.0.11",
    "rollout0": "198.18.0.20",
    "rollout1": "198.18.0.21",
    "rollout2": "198.18.0.22",
    "reward": "198.18.0.30",
}
RUN_ID = "cluster"
BATCH = 4  # train_batch_size
TETHER = [sys.executable, "-m", "tether"]
ENV = {"GLOO_SOCKET_IFNAME": "tun0", "OMP_NUM_THREADS": "1", "TETHER_AUTH_TOKEN": "cluster-test-token"}


class Cluster:
    def __init__(self, folder: Path, model_dir: Path, *, steps: int, staleness: int = 1, **overrides: dict) -> None:
        self.folder = Path(folder)
        self.lab = Lab(self.folder / "lab", HOSTS)
        self.steps = steps
        self.redis_url = f"redis://{HOSTS['redis']}:6379/0"
        self.run_dir = self.folder / "runs" / RUN_ID
        self.config = self.folder / "cluster.yaml"
        cfg = {
            "run": {"output_dir": str(self.folder / "runs"), "loggers": ["console"]},
            "model": {"path": str(model_dir)},
            "rollout": {
                "engine": {"type": "transformers", "max_num_seqs": 64},
                "reward": {"type": "remote", "address": f"{HOSTS['reward']}:50070", "timeout_s": 10},
                "n": 4,
                "max_tokens": 4,
                "heartbeat_s": 1.0,
                "drain_timeout_s": 5,
            },
            "learner": {
                "total_steps": steps,
                "train_batch_size": BATCH,
                "lr": 1e-4,
                "data_path": "demo:addition",
                "checkpoint_every": 0,
                "read_timeout_s": 300,
                "export_hf": False,
            },
            "algorithm": {"max_staleness": staleness},
            "buffer": {"claim_idle_ms": 10_000},
            "weight_sync": {
                "transport": {"type": "gloo", "master_port": 29600},
                "prepare_timeout_s": 5,
                "transfer_timeout_s": 15,
                "commit_timeout_s": 10,
            },
        }
        for section, values in overrides.items():
            cfg.setdefault(section, {}).update(values)
        self.config.write_text(yaml.safe_dump(cfg))
        self.learners: list[subprocess.Popen] = []
        self.redis: subprocess.Popen | None = None

    # -- the processes, as FLEETS.md starts them --------------------------------------------------------
    def start(self, *, rollouts: tuple[str, ...] = ("rollout0", "rollout1")) -> Cluster:
        self.lab.start()
        self.start_redis()
        self.lab.run("reward", [sys.executable, "examples/reward_service.py", "--host", HOSTS["reward"],
                                "--port", "50070"], name="reward", env=ENV)  # fmt: skip
        for host in rollouts:
            self.start_rollout(host)
        for rank in (0, 1):
            self.learners.append(self.lab.run(f"learner{rank}", [
                *TETHER, "learner", "--config", str(self.config), "--run.run_id", RUN_ID, "--nnodes", "2",
                "--node-rank", str(rank), "--rdzv-endpoint", f"{HOSTS['learner0']}:29500",
                "--local-addr", HOSTS[f"learner{rank}"],
                "--buffer.redis_url", self.redis_url, "--weight_sync.transport.master_addr", HOSTS["learner0"],
            ], name=f"learner{rank}", env=ENV))  # fmt: skip
        return self

    def start_redis(self) -> None:
        data = self.folder / "redis-data"
        data.mkdir(exist_ok=True)
        self.redis = self.lab.run("redis", [
            redis_executable(), "--bind", HOSTS["redis"], "--port", "6379", "--appendonly", "yes",
            "--appendfsync", "everysec", "--dir", str(data), "--save", "", "--protected-mode", "no",
        ], name="redis")  # fmt: skip

    def start_rollout(self, host: str) -> subprocess.Popen:
        return self.lab.run(host, [
            *TETHER, "rollout", "--config", str(self.config), "--run.run_id", RUN_ID, "--rollout.host", HOSTS[host],
            "--rollout.port", "50051", "--rollout.metrics_port", "9100", "--rollout.server_id", host,
            "--buffer.redis_url", self.redis_url, "--weight_sync.transport.master_addr", HOSTS["learner0"],
            "--rollout.reward.token", ENV["TETHER_AUTH_TOKEN"],
        ], name=host, env=ENV)  # fmt: skip

    def close(self) -> None:
        self.lab.close()
        # torchrun starts its ranks in sessions of their own: one whose agent was killed before it could stop
        # them would live on, so anything still naming this cluster's config goes too.
        for pid in processes_mentioning(str(self.config)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # -- observing ---------------------------------------------------------------------------------------
    def probe(self, host: str, code: str, timeout_s: float = 60) -> dict:
        """Run Python ``code`` inside ``host`` (it prints one JSON object); that object."""
        out = subprocess.run(["ip", "netns", "exec", self.lab.ns[host], sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=timeout_s, cwd=self.lab.folder)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"probe in {host} failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def registry(self) -> dict:
        """Live rollout servers (id -> policy version) and the published version, read inside the Redis host."""
        return self.probe(
            "redis",
            f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import redis
from buffer import RedisKeys, ServerRegistry, read_version
c = redis.Redis.from_url({self.redis_url!r})
k = RedisKeys({RUN_ID!r})
print(json.dumps({{"version": read_version(c, k), "servers": {{s.server_id: s.policy_version
      for s in ServerRegistry(c, k).live()}}}}))
""",
        )

    def groups_written(self, host: str) -> float:
        """The rollout server's own count of groups it wrote (its Prometheus counter, read on its host)."""
        text = self.probe(
            host,
            f"""
import json, urllib.request
body = urllib.request.urlopen("http://{HOSTS[host]}:9100/metrics", timeout=5).read().decode()
print(json.dumps({{"n": sum(float(l.split()[-1]) for l in body.splitlines()
      if l.startswith("tether_rollout_groups_written_total"))}}))
""",
        )
        return text["n"]

    def steps_done(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [r for r in read_metrics(path) if r.get("reward/mean") is not None] if path.exists() else []

    def wait_for_step(self, step: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.steps_done()
            if rows and rows[-1]["step"] >= step:
                return
            for proc in self.learners:
                if proc.poll() not in (None, 0):
                    raise AssertionError(f"a learner failed ({proc.returncode}):\n{self.logs()}")
            time.sleep(0.3)
        raise AssertionError(f"step {step} not reached in {timeout_s}s:\n{self.logs()}")

    def wait_finished(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.learners:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the learner did not finish in {timeout_s}s:\n{self.logs()}") from None
            assert proc.returncode == 0, f"learner exited {proc.returncode}:\n{self.logs()}"

    def books(self) -> dict:
        return json.loads((self.run_dir / "buffer_stats.json").read_text())["books"]["run"]

    def logs(self, tail: int = 1500) -> str:
        names = ["learner0", "learner1", "rollout0", "rollout1", "rollout2", "redis", "reward", "switch"]
        return "\n".join(f"--- {n}\n{self.lab.log(n)[-tail:]}" for n in names if self.lab.log(n))
