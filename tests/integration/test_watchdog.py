"""The watchdog on real stalls: ``tether up`` runs until a part of the run hangs, and its console and
``tether status`` name the stage that is stuck and its process — a reward service that stops answering
(a real gRPC server that sleeps), a rollout server that is stopped (SIGSTOP), the run's Redis stopped
(SIGSTOP), and weight sync held by a relay that stops answering."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import interruptible
from tests.integration.test_up import REPO, write_config
from tether.redis_server import free_port

REWARD_SERVER = """
import asyncio, sys
from tether.reward_service import RewardService, start_server
from tether.tasks import demo_reward

class Stalling(RewardService):
    calls = 0
    async def score(self, req):
        Stalling.calls += 1
        if Stalling.calls > int(sys.argv[2]):
            await asyncio.sleep(3600)  # the service hangs: calls neither answer nor fail
        return demo_reward(req.completion, dict(req.reward_context))

async def main():
    server, _, _ = await start_server(Stalling(), port=int(sys.argv[1]), host="127.0.0.1")
    await server.wait_for_termination()

asyncio.run(main())
"""


def _up(tmp_path: Path, model: Path, run_id: str, **changes: dict) -> tuple[subprocess.Popen, Path, Path]:
    cfg_path = write_config(tmp_path, model, run_id=run_id, steps=500)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["run"].update(watchdog_k=3.0, watchdog_floor_s=8.0)
    for section, values in changes.items():
        cfg.setdefault(section, {}).update(values)
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "up.out"
    proc = subprocess.Popen([sys.executable, "-m", "tether", "up", "--config", str(cfg_path)], cwd=REPO,
                            stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=interruptible)  # fmt: skip
    return proc, out, cfg_path


def _wait(what: str, check, timeout_s: float, proc: subprocess.Popen, out: Path):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        assert proc.poll() is None, f"tether up ended early:\n{out.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{out.read_text()[-3000:]}")


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _warning(out: Path, needle: str) -> str | None:
    for line in out.read_text().splitlines():
        if "tether: warning: no learner step" in line and needle in line:
            return line
    return None


@pytest.mark.slow
def test_a_hung_reward_service_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    reward = subprocess.Popen([sys.executable, "-c", REWARD_SERVER, str(port), "120"], cwd=REPO)
    address = f"127.0.0.1:{port}"
    remote = {"type": "remote", "address": address, "timeout_s": 600, "max_retries": 0}
    proc, out, cfg = _up(tmp_path, tiny_model_dir, "stall-reward", rollout={"reward": remote})
    try:
        line = _wait("the watchdog's warning", lambda: _warning(out, "reward call to"), 300, proc, out)
        assert f"reward call to {address} open for" in line and ": rollout-" in line, line
        status = subprocess.run([sys.executable, "-m", "tether", "status", "--config", str(cfg)], cwd=REPO,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "stuck: no learner step for" in status.stdout and f"reward call to {address}" in status.stdout, (
            status.stdout + status.stderr
        )
    finally:
        _stop(proc)
        reward.kill()
        reward.wait()


@pytest.mark.slow
def test_a_stopped_rollout_server_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc, out, _ = _up(tmp_path, tiny_model_dir, "stall-rollout", rollout={"num_servers": 1})
    run = tmp_path / "runs" / "stall-rollout"
    stopped = None
    try:
        _wait("three learner steps", lambda: _steps(run) >= 3, 240, proc, out)
        stopped = json.loads((run / "spans" / "rollout-0.open.json").read_text())["pid"]
        os.kill(stopped, signal.SIGSTOP)
        line = _wait("the watchdog's warning", lambda: _warning(out, "rollout-0: not responding"), 120, proc, out)
        assert "rollout-0: not responding for" in line, line
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        _stop(proc)


@pytest.mark.slow
def test_a_stopped_redis_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tether.redis_server import EmbeddedRedis

    redis = EmbeddedRedis(tmp_path / "redis")
    url = redis.start()
    address = url.split("//", 1)[1].split("/", 1)[0]
    proc, out, _ = _up(tmp_path, tiny_model_dir, "stall-redis", buffer={"redis_url": url})
    run = tmp_path / "runs" / "stall-redis"
    stopped = False
    try:
        _wait("three learner steps", lambda: _steps(run) >= 3, 240, proc, out)
        assert redis.process is not None
        os.kill(redis.process.pid, signal.SIGSTOP)
        stopped = True
        line = _wait("the watchdog's warning", lambda: _warning(out, f"redis to {address}"), 180, proc, out)
        assert f"redis to {address} open for" in line and ": rollout-" in line, line
    finally:
        if stopped:
            os.kill(redis.process.pid, signal.SIGCONT)
        _stop(proc)
        redis.stop()


class _HangingRelay:
    """A relay (a real WeightStore gRPC service) that has no plan and no chunk for its first ``after`` chunk
    requests (the servers go on to the origin), then holds every chunk request: each pull stalls in weight sync."""

    def __init__(self, after: int) -> None:
        import threading

        self.after, self.calls, self.release = after, 0, threading.Event()

    def plan(self, version, held):  # type: ignore[no-untyped-def]
        from weight_sync.store import VersionMissing

        raise VersionMissing("a relay with no plans")

    def chunk(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        self.calls += 1
        if self.calls > self.after:
            self.release.wait(600)
        return None


@pytest.mark.slow
def test_a_stalled_weight_fetch_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    from weight_sync.chunk_service import serve

    relay = _HangingRelay(after=60)
    service = serve(relay, host="127.0.0.1")
    store = {"type": "store", "fanout": 0, "relays": [service.address], "chunk_timeout_s": 600}
    proc, out, _ = _up(tmp_path, tiny_model_dir, "stall-weights", weight_sync={"transport": store})
    try:
        line = _wait("the watchdog's warning", lambda: _warning(out, "weight"), 300, proc, out)
        assert "weight await fleet open for" in line or "weight fetch open for" in line, line
        assert relay.calls > relay.after  # the servers were held by the relay when the run stalled
    finally:
        relay.release.set()
        _stop(proc)
        service.stop(0)
