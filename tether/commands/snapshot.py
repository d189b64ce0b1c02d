"""One reading of a run's Redis keys, and what two readings say, for ``tether status`` and the console.

A :class:`RunSnapshot` holds the published policy version, the buffer's stats (``buffer.stats.buffer_stats``)
and the learner's hash at one moment; rates are differences between two snapshots over the local clock, so
they need no clock agreement between hosts.
"""

from __future__ import annotations

import time

import redis

from buffer import RedisKeys, buffer_stats, read_version
from buffer.replies import str_keys, text


class RunSnapshot:
    """The run's published version, buffer stats and learner hash, read from Redis at one moment."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self.time = time.monotonic()
        self.version = read_version(client, keys)
        self.stats = buffer_stats(client, keys)
        self.learner = str_keys(client.hgetall(keys.learner))

    def learner_str(self, name: str) -> str:
        raw = self.learner.get(name)
        return text(raw, errors="replace") if isinstance(raw, bytes) else "-"

    def learner_float(self, name: str) -> float | None:
        try:
            return float(self.learner[name])
        except (KeyError, ValueError, TypeError):
            return None


def rate(new: RunSnapshot, old: RunSnapshot | None, key: str) -> float | None:
    """How fast the stat ``key`` moved per second between ``old`` and ``new`` (None without an ``old``)."""
    if old is None or new.time <= old.time:
        return None
    return (new.stats[key] - old.stats[key]) / (new.time - old.time)


def recent_staleness(new: RunSnapshot, old: RunSnapshot | None) -> float:
    """Mean staleness of groups trained on since ``old`` (all of the run's when there is no ``old``)."""
    lags = {}
    for k, v in new.stats.items():
        if k.startswith("buffer/staleness/"):
            lag = int(k.rsplit("/", 1)[1])
            lags[lag] = v - (old.stats.get(k, 0.0) if old else 0.0)
    total = sum(lags.values())
    return sum(k * v for k, v in lags.items()) / total if total > 0 else new.stats.get("buffer/staleness_mean", 0.0)


def fmt(value: float | None, spec: str = ".1f") -> str:
    """``value`` formatted by ``spec``, or "-" when there is none."""
    return "-" if value is None else format(value, spec)
