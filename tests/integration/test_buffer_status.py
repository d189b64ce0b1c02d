"""``tether status``, the progress line of ``tether up``, and the buffer benchmark's smoke run."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import redis

from buffer import RedisKeys, ServerInfo, ServerRegistry, TrajectoryReader, TrajectoryWriter, publish_version
from tests.unit.test_buffer_codec import make_group
from tether.commands.console import ProgressLine
from tether.commands.status import show_status
from tether.config import TetherConfig
from tether.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def _cfg(url: str) -> TetherConfig:
    return TetherConfig.model_validate({"run": {"run_id": "s1"}, "buffer": {"redis_url": url}})


def _populate(client: redis.Redis, cfg: TetherConfig) -> None:
    keys = RedisKeys("s1")
    writer, reader = TrajectoryWriter(client, keys, cfg.buffer), TrajectoryReader(client, keys, cfg.buffer)
    for i in range(3):
        writer.put(make_group(seed=i, version=3))
    writer.put(make_group(seed=9, version=1, tokens=100))  # oldest tokens v0: dropped as stale at v3
    got = reader.read(3, current_version=3, max_staleness=1, block_ms=300)
    reader.ack([b.entry_id for b in got[:2]])
    reader.give_back(got[2:])  # still in the buffer: depth 1
    publish_version(client, keys, 3)
    client.hset(keys.learner, mapping={"step": 12, "reward_mean": 0.625, "tokens_per_s": 1500})
    ServerRegistry(client, keys).heartbeat(ServerInfo("rollout-0", address="127.0.0.1:7001", engine="transformers"))


def test_show_status_prints_version_buffer_and_servers(redis_client: redis.Redis, redis_url: str) -> None:
    cfg = _cfg(redis_url)
    _populate(redis_client, cfg)
    out = io.StringIO()
    assert show_status(cfg, out=out, interval_s=0.01) == 0
    text = out.getvalue()
    assert "policy version 3" in text
    assert "learner step 12" in text
    assert "depth 1" in text
    assert "acknowledged 2" in text
    # The length book: 8 completions of 16 tokens trained, 4 of 100 dropped stale (the given-back one is unsettled)
    assert "completion lengths: TV(generated, trained) 0.333" in text
    assert re.search(r"91-127\s+4\s+0\s+4\s+100\.0%", text), text
    assert re.search(r"rollout-0\s+127\.0\.0\.1:7001\s+transformers", text)


def test_show_status_without_redis_says_so(capsys) -> None:
    assert show_status(_cfg(f"redis://127.0.0.1:{free_port()}/0"), out=io.StringIO(), interval_s=0.01) == 1
    assert "redis: unreachable" in capsys.readouterr().err


def test_progress_line(redis_client: redis.Redis, redis_url: str) -> None:
    cfg = _cfg(redis_url)
    _populate(redis_client, cfg)
    line = ProgressLine(cfg, out=io.StringIO())
    text = line.line()
    assert text.startswith("step 12 | v3 | reward 0.625")
    assert "buffer 1" in text
    assert "\n" not in text
    line.update()
    line.close()


def test_progress_line_never_raises_when_redis_is_down() -> None:
    out = io.StringIO()
    line = ProgressLine(_cfg(f"redis://127.0.0.1:{free_port()}/0"), out=out, quiet_every_s=0)
    assert line.line() == "redis: unreachable"
    line.update()
    line.close()
    assert "redis: unreachable" in out.getvalue()


def test_buffer_benchmark_quick_run_prints_ratios() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/buffer.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln for ln in proc.stdout.splitlines() if re.match(r"\s*(1024|4096|16384)\s", ln)]
    assert len(rows) == 6, proc.stdout  # each size one put at a time, then put_many
    assert sum("put_many" in row for row in rows) == 3, proc.stdout
    for row in rows:  # the ratio and the two CPU columns are numbers; their values are never asserted
        cells = row.split()
        float(cells[-6]), float(cells[-2]), float(cells[-1])
    assert "ratio" in proc.stdout
    # Each wall-clock figure has its CPU twin (client + Redis CPU seconds, raw's over the buffer's).
    for size in ("1K", "4K", "16K"):
        for mode in ("", "_put_many"):
            assert f"FIGURE buffer/{size}_tokens{mode}: " in proc.stdout, proc.stdout
            assert f"FIGURE buffer/{size}_tokens{mode}_cpu: " in proc.stdout, proc.stdout
