"""``tether status``: a run, as Redis sees it (snapshots from ``tether.commands.snapshot``, as the console's).

Everything shown is read from the run's Redis keys (``buffer.keys.RedisKeys``): the published policy
version, the learner's hash (``step``, ``reward_mean``, ``tokens_per_s`` when it publishes them), buffer
counters and the server registry. Rates are differences between two snapshots, so they need no clock
agreement between hosts. Neither view may take a run down: every Redis error becomes "redis: unreachable".
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import redis

from buffer import RedisKeys, ServerRegistry
from buffer.ledger import format_books, run_books
from buffer.lengths import LengthBook
from buffer.replies import str_keys
from tether.commands.snapshot import RunSnapshot, fmt, rate
from tether.commands.watchdog import Watchdog
from tether.config import TetherConfig
from tether.redis_server import RedisUnavailable, connect_redis
from tether.runs import run_paths

_ERRORS = (redis.RedisError, RedisUnavailable, OSError, ValueError)


def _validation_line(snap: RunSnapshot) -> str:
    """The latest evaluation round the learner logged (``learner.test_freq``), or that there is none."""
    if snap.learner_str("val_step") == "-":
        return "validation: -"
    k = snap.learner_float("val_k")
    k_str = "k" if k is None else f"{k:.0f}"
    return (
        f"validation (step {snap.learner_str('val_step')}): mean@{k_str} "
        f"{fmt(snap.learner_float('val_mean_at_k'), '.3f')}   pass@{k_str} "
        f"{fmt(snap.learner_float('val_pass_at_k'), '.3f')}   "
        f"missing {fmt(snap.learner_float('val_missing'), '.0f')}"
    )


def stuck_line(cfg: TetherConfig) -> str:
    """A line naming the stuck stage when no learner step came for too long (the watchdog); else ""."""
    paths = run_paths(cfg)
    try:
        since = paths.config.stat().st_mtime  # this lifetime's start: tether up writes the config then
    except OSError:
        return ""
    stuck = Watchdog(paths.root, k=cfg.run.watchdog_k, floor_s=cfg.run.watchdog_floor_s, since=since).check()
    return f"\nstuck: {stuck}" if stuck else ""


def render_status(cfg: TetherConfig, client: redis.Redis, new: RunSnapshot, old: RunSnapshot | None) -> str:
    keys = RedisKeys(cfg.run.run_id or "")
    s = new.stats
    tokens_per_s = new.learner_float("tokens_per_s")
    lines = [
        f"run {cfg.run.run_id}   policy version {new.version}   learner step {new.learner_str('step')}",
        f"reward mean {fmt(new.learner_float('reward_mean'), '.3f')}   learner tokens/s {fmt(tokens_per_s, '.0f')}",
        _validation_line(new),
        "",
        f"buffer: depth {s['buffer/depth']:.0f}   pending {s['buffer/pending']:.0f}   "
        f"{s['buffer/bytes'] / 2**20:.1f} MiB   oldest {s['buffer/oldest_age_s']:.1f}s   "
        f"prompts queued {s['buffer/prompts_depth']:.0f} (issued {s['buffer/prompts_issued']:.0f})",
        f"groups: produced {s['buffer/produced']:.0f}   consumed {s['buffer/consumed']:.0f}   "
        f"acknowledged {s['buffer/acknowledged']:.0f}   dropped stale {s['buffer/dropped_stale']:.0f} "
        f"(episodes {s['buffer/dropped_stale_env']:.0f})   "
        f"dead letter {s['buffer/dead_letter']:.0f}   duplicates {s['buffer/duplicates']:.0f}",
        f"episode groups never filled {s['buffer/episode_groups_incomplete']:.0f}   "
        f"episodes never closed {s.get('buffer/episodes_expired', 0):.0f} (dead-lettered)",
        f"staleness: mean {s['buffer/staleness_mean']:.2f}   max {s['buffer/staleness_max']:.0f}   "
        f"(max_staleness {cfg.algorithm.max_staleness})",
        f"throughput: produced {fmt(rate(new, old, 'buffer/produced'))} groups/s   "
        f"trained {fmt(rate(new, old, 'buffer/acknowledged'))} groups/s   "
        f"generated {fmt(rate(new, old, 'buffer/tokens'), '.0f')} tokens/s",
        "",
    ]
    lines += [*format_books(run_books(client, keys)), ""]
    lengths = LengthBook.from_hash(str_keys(client.hgetall(keys.lengths))).table()
    if lengths:
        lines += [*lengths, ""]
    servers = ServerRegistry(client, keys).live()
    lines.append(f"rollout servers: {len(servers)} live")
    if servers:
        lines.append(f"  {'id':<20} {'address':<22} {'engine':<13} {'version':>7} {'heartbeat':>9}")
        for info in servers:
            lines.append(
                f"  {info.server_id:<20} {info.address:<22} {info.engine:<13} {info.policy_version:>7} "
                f"{info.heartbeat_age_s:>8.1f}s"
            )
    return "\n".join(lines)


def _embedded_url(cfg: TetherConfig) -> str:
    """The address ``tether up`` wrote for its embedded Redis while the run is up ("" otherwise)."""
    try:
        return run_paths(cfg).redis_url_file.read_text().strip()
    except (OSError, ValueError):
        return ""


def show_status(cfg: TetherConfig, *, watch: bool = False, out: TextIO | None = None, interval_s: float = 1.0) -> int:
    """Print the run's status (read twice for rates); with ``watch``, refresh until Ctrl-C. 0, or 1 when
    Redis cannot be reached."""
    out = out or sys.stdout
    keys = RedisKeys(cfg.run.run_id or "")
    url = cfg.buffer.redis_url or _embedded_url(cfg)
    if not url:
        folder = run_paths(cfg).root
        print(
            f"tether status: run {cfg.run.run_id!r} uses the embedded Redis, which is not running (the run is not "
            f"running here, or never ran in {folder}); its last books are in {folder / 'buffer_stats.json'}",
            file=sys.stderr,
        )
        return 1
    try:
        client = connect_redis(url, timeout_s=2.0)
    except RedisUnavailable as e:
        print(f"tether status: redis: unreachable — {e}", file=sys.stderr)
        return 1
    try:
        old = RunSnapshot(client, keys)
        while True:
            time.sleep(interval_s)
            new = RunSnapshot(client, keys)
            text = render_status(cfg, client, new, old) + stuck_line(cfg)
            if watch and out.isatty():
                out.write("\x1b[H\x1b[2J")  # clear the screen: a top-like view
            out.write(text + "\n")
            out.flush()
            if not watch:
                return 0
            old = new
    except KeyboardInterrupt:
        return 0
    except _ERRORS as e:
        print(f"tether status: redis: unreachable — {e}{stuck_line(cfg)}", file=sys.stderr)
        return 1
    finally:
        client.close()
