"""A run's config in Redis, for the rollout fleets that serve several runs (``tether rollout --runs a,b``).

The learner publishes its config at start; a fleet serves the run with it — the run's model, sampling,
reward, tasks, weight transport and share — under its own engine, network and credentials. What is secret
or bound to the learner's host is left out of the published copy: the Redis URL (it may hold a password),
the auth token and TLS files, the server's address and identity.
"""

from __future__ import annotations

import json

import redis

from buffer.keys import RUNS, RedisKeys
from buffer.replies import text

HOST_BOUND = {
    "buffer": ("redis_url",),
    "rollout": ("auth_token", "tls_cert", "tls_key", "host", "port", "server_id", "metrics_port"),
}
"""Sections and keys never published: the fleet's own values stand."""


def published_copy(config: dict) -> dict:
    """``config`` (a ``TetherConfig`` dumped as JSON-ready dict) without the :data:`HOST_BOUND` keys."""
    out = {section: dict(body) if isinstance(body, dict) else body for section, body in config.items()}
    for section, keys in HOST_BOUND.items():
        for key in keys:
            if isinstance(out.get(section), dict):
                out[section].pop(key, None)
    return out


def publish_run_config(client: redis.Redis, keys: RedisKeys, config: dict) -> None:
    """Publish the run's config and add the run to :data:`buffer.keys.RUNS` (the runs that ask for fleets)."""
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.run_config, json.dumps(published_copy(config)))
    pipe.sadd(RUNS, keys.run_id)
    pipe.execute()


def asking_runs(client: redis.Redis) -> list[str]:
    """The runs whose learners published a config and whose end is not published, sorted."""
    runs = sorted(text(r) for r in client.smembers(RUNS))
    if not runs:
        return []
    pipe = client.pipeline(transaction=False)
    for run in runs:
        pipe.exists(RedisKeys(run).run_end)
    return [run for run, ended in zip(runs, pipe.execute(), strict=True) if not ended]


def read_run_config(client: redis.Redis, keys: RedisKeys) -> dict | None:
    """The run's published config; None before its learner has started (or from a learner before fleets)."""
    raw = client.get(keys.run_config)
    if raw is None:
        return None
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{keys.run_config}: not JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError(f"{keys.run_config}: a JSON object expected, got {type(body).__name__}")
    return body
