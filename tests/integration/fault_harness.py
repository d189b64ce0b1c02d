"""The pieces of a tether run started one by one, so a fault test can kill and restart any of them.

``tether up`` supervises its children and stops the whole run when one dies; a fault test needs the
opposite — Redis that outlives the learner, a rollout server killed while its siblings keep going — so
it owns a :class:`~tether.redis_server.EmbeddedRedis` and starts the learner (under torchrun) and the
rollout servers itself, with the same commands ``tether up`` uses. Every child runs in its own process
group (a SIGKILL of the group is what a crashed host looks like) and dies with the test process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml

from buffer import RedisKeys, ServerRegistry, buffer_stats, read_version
from tests.helpers import interruptible
from tether.metrics import read_metrics
from tether.orphans import die_with_parent

REPO = Path(__file__).resolve().parents[2]


def _child_setup() -> None:  # between fork and exec: own process group, Ctrl-C-able, and die with the test
    os.setsid()
    interruptible()
    die_with_parent(signal.SIGKILL)


def write_config(
    tmp_path: Path,
    model: Path,
    *,
    run_id: str,
    redis_url: str,
    steps: int,
    checkpoint_every: int = 0,
    learner: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
) -> Path:
    """A small run: train_batch_size 2, G = 4, 8 new tokens, claim_idle_ms 2000, filesystem weight sync."""
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path / "runs"), "loggers": ["console"]},
        "model": {"path": str(model)},
        "rollout": {
            "engine": {"type": "transformers", "max_num_seqs": 16},
            "reward": {"type": "demo"},
            "n": 4,
            "max_tokens": 8,
            "prompt_workers": 2,
            # a SIGKILLed server's registry entry expires after 3 heartbeats, so updates stop trying it
            "heartbeat_s": 0.5,
            "drain_timeout_s": 5,
            **(rollout or {}),
        },
        # a dead consumer's prompts / groups are reclaimed after 2 s instead of the default minute
        "buffer": {"redis_url": redis_url, "claim_idle_ms": 2000},
        "learner": {
            "total_steps": steps,
            "train_batch_size": 2,
            "lr": 1e-3,
            "data_path": "demo:charclass",
            "checkpoint_every": checkpoint_every,
            "export_hf": False,
            "read_timeout_s": 240,
            **(learner or {}),
        },
        "algorithm": {"max_staleness": 1},
        # a killed server must not hold an update up for the default 30 s prepare deadline
        "weight_sync": {"transport": {"type": "filesystem"}, "prepare_timeout_s": 5, "commit_timeout_s": 20},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


class Proc:
    """One child process, its output in ``log``."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name, self.log = name, log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_child_setup
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to this child and all its descendants (torchrun puts its ranks in sessions of
        their own, so signalling the process group would miss them)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL to the process and everything under it: no handler runs, nothing drains."""
        self.signal_tree(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM (a server drains), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def tail(self, chars: int = 3000) -> str:
        try:
            return f"--- {self.name}\n{self.log.read_text(errors='replace')[-chars:]}"
        except OSError:
            return f"--- {self.name}: no output"


class Run:
    """A run's processes and its Redis keys; ``run.close()`` stops whatever is still running."""

    def __init__(self, tmp_path: Path, config: Path, run_id: str, redis_url: str) -> None:
        self.tmp_path, self.config, self.run_id = tmp_path, config, run_id
        self.dir = tmp_path / "runs" / run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keys = RedisKeys(run_id)
        self.redis_url = redis_url
        self.procs: list[Proc] = []

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=10)

    def learner(self, *, resume: bool = False) -> Proc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "learner", "--config", str(self.config)] + (["--resume"] if resume else [])  # fmt: skip
        return self._start(f"learner{'-resumed' if resume else ''}", cmd)

    def server(self, server_id: str, *overrides: str) -> Proc:
        cmd = [sys.executable, "-m", "rollout_server", "--config", str(self.config), "--rollout.server_id", server_id]
        cmd += overrides
        return self._start(server_id, cmd)

    def _start(self, name: str, cmd: list[str]) -> Proc:
        proc = Proc(name, cmd, self.tmp_path / f"{name}.out")
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs) + "\n" + self.buffer_dump()

    def buffer_dump(self) -> str:
        """The buffer's books and consumer groups, for failure messages (never raises)."""
        try:
            client = self.client()
            try:
                lines = [f"stats: {buffer_stats(client, self.keys)}", f"version: {read_version(client, self.keys)}"]
                for stream in (self.keys.prompts, self.keys.trajectories):
                    lines += [f"{stream} group: {g}" for g in client.xinfo_groups(stream)]
                return "\n".join(lines)
            finally:
                client.close()
        except Exception as e:  # diagnostics only: Redis may be the thing that is down
            return f"(no buffer dump: {e!r})"

    def steps(self) -> list[int]:
        """The learner steps logged so far, in the order they were logged (a resumed run repeats some)."""
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [int(r["step"]) for r in read_metrics(path) if r.get("data/groups") is not None]

    def stats(self) -> dict[str, float]:
        client = self.client()
        try:
            return buffer_stats(client, self.keys)
        finally:
            client.close()

    def version(self) -> int:
        client = self.client()
        try:
            return read_version(client, self.keys)
        finally:
            client.close()

    def registry_versions(self) -> dict[str, int]:
        """server id -> the policy version its last heartbeat reported."""
        client = self.client()
        try:
            return {s.server_id: s.policy_version for s in ServerRegistry(client, self.keys).live()}
        finally:
            client.close()

    def wait_for(self, what: str, check: Callable[[], bool], *, timeout_s: float = 150,
                 must_live: tuple[Proc, ...] = (), poll_s: float = 0.1) -> None:  # fmt: skip
        """Poll ``check`` until true; fail with every child's output when it is not in time or a child died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            dead = [p.name for p in must_live if not p.alive()]
            if dead:
                raise AssertionError(f"{dead} exited while waiting for {what}\n{self.logs()}")
            time.sleep(poll_s)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.alive():
                p.kill()
