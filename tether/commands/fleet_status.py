"""``tether status --fleets``: every rollout fleet serving several runs, and each run it serves.

Read from Redis alone (:mod:`buffer.fleets` and each run's keys): per fleet its host and gate capacity; per
run its share, its part of the tokens the fleet generated, the groups waiting for and holding a turn, the
run's published policy version beside the version its slot serves, and the staleness of what the run's
learner trained on (mean and max, against the run's ``max_staleness`` when the run published its config).
"""

from __future__ import annotations

import sys
from typing import TextIO

import redis

from buffer import RedisKeys, ServerRegistry, buffer_stats, read_version
from buffer.fleets import FleetState, live_fleets
from buffer.run_config import read_run_config
from tether.config import TetherConfig
from tether.redis_server import RedisUnavailable, connect_redis

HEADER = (f"  {'run':<18} {'share':>5} {'tokens':>7} {'groups':>7} {'wait':>4} {'run':>3} "
          f"{'version':>7} {'served':>6} {'staleness':>14} server")  # fmt: skip


def _run_line(client: redis.Redis, run: str, figures: dict, part: float) -> str:
    keys = RedisKeys(run)
    slot = figures.get("server_id")
    served = next((s.policy_version for s in ServerRegistry(client, keys).live() if s.server_id == slot), None)
    stats = buffer_stats(client, keys)
    config = read_run_config(client, keys) or {}
    bound = (config.get("algorithm") or {}).get("max_staleness", "-")
    staleness = f"{stats['buffer/staleness_mean']:.2f}/{stats['buffer/staleness_max']:.0f} (≤{bound})"
    return (
        f"  {run:<18} {figures.get('share', 0):>5g} {part:>6.1%} {figures.get('groups', 0):>7.0f} "
        f"{figures.get('waiting', 0):>4.0f} {figures.get('inflight', 0):>3.0f} {read_version(client, keys):>7} "
        f"{'-' if served is None else served:>6} {staleness:>14} {figures.get('server_id', '')}"
    )


def render_fleets(client: redis.Redis, fleets: list[FleetState]) -> str:
    if not fleets:
        return "no rollout fleet serving several runs is live (tether rollout --runs ...)"
    lines = []
    for fleet in fleets:
        total = sum(float(r.get("tokens", 0)) for r in fleet.runs.values()) or 1.0
        lines += [f"fleet {fleet.fleet_id} on {fleet.host}: {len(fleet.runs)} runs, generations {fleet.capacity} "
                  "at a time", HEADER]  # fmt: skip
        lines += [
            _run_line(client, run, fig, float(fig.get("tokens", 0)) / total) for run, fig in sorted(fleet.runs.items())
        ]
        lines.append("")
    return "\n".join(lines).rstrip()


def show_fleets(cfg: TetherConfig, *, out: TextIO | None = None) -> int:
    """Print every live fleet; 0, or 1 when Redis cannot be reached."""
    out = out or sys.stdout
    if not cfg.buffer.redis_url:
        print("tether status --fleets: set buffer.redis_url (the Redis the fleets and runs share)", file=sys.stderr)
        return 1
    try:
        client = connect_redis(cfg.buffer.redis_url, timeout_s=2.0)
    except RedisUnavailable as e:
        print(f"tether status: redis: unreachable — {e}", file=sys.stderr)
        return 1
    try:
        out.write(render_fleets(client, live_fleets(client)) + "\n")
        return 0
    except (redis.RedisError, OSError, ValueError) as e:
        print(f"tether status: redis: unreachable — {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
