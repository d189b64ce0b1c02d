"""``buffer_stats``: one pipelined snapshot of the buffer as flat ``buffer/...`` metrics.

Everything comes from one round trip so ``tether status --watch`` and the learner's per-step metrics
cost Redis almost nothing. The oldest entry's age is computed by a tiny script on Redis' own clock
(no host clock involved) and without sending the entry's payload back. A missing stream or group
reads as zero, never as an error: stats are asked for before the first producer starts.
"""

from __future__ import annotations

import redis

from buffer.keys import LEARNER_GROUP, RedisKeys
from buffer.lengths import LengthBook
from buffer.replies import str_keys, text

# KEYS: stream. Returns {oldest id or '', server time s, server time µs}.
_OLDEST = """
local t = redis.call('TIME')
local e = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if e[1] then return {e[1][1], t[1], t[2]} end
return {'', t[1], t[2]}
"""

COUNTERS = (
    "produced",
    "produced_bytes",
    "tokens",
    "consumed",
    "acknowledged",
    "dropped_stale",
    "dropped_stale_env",
    "episode_groups_incomplete",
    "episodes_expired",
    "dead_letter",
    "duplicates",
    "prompts_issued",
    "prompts_done",
    "prompts_dead_letter",
)


def _ok(reply: object, default: object) -> object:
    return default if isinstance(reply, Exception) or reply is None else reply


def _oldest_age_s(reply: object) -> float:
    if isinstance(reply, Exception) or not reply:
        return 0.0
    first, secs, usecs = reply
    first = text(first)
    if not first:
        return 0.0
    now_ms = int(secs) * 1000 + int(usecs) // 1000
    return max(0.0, (now_ms - int(first.split("-")[0])) / 1000)


def buffer_stats(client: redis.Redis, keys: RedisKeys) -> dict[str, float]:
    """Depth, bytes, oldest age, counters, the staleness histogram of the trained-on groups, and whether
    what was trained has the length distribution of what was generated (:mod:`buffer.lengths`)."""
    oldest = client.register_script(_OLDEST)
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.trajectories)
    pipe.hgetall(keys.counters)
    pipe.hgetall(keys.staleness)
    oldest(keys=[keys.trajectories], client=pipe)
    pipe.xpending(keys.trajectories, LEARNER_GROUP)
    pipe.xlen(keys.prompts)
    pipe.xlen(keys.dead_letter)
    pipe.get(keys.version)
    pipe.hgetall(keys.lengths)
    depth, counters, hist, age, pending, prompts, dead, version, lengths = pipe.execute(raise_on_error=False)

    counters = str_keys(dict(_ok(counters, {})))
    out: dict[str, float] = {
        "buffer/depth": float(_ok(depth, 0)),
        "buffer/bytes": float(counters.get("bytes", 0)),
        "buffer/oldest_age_s": _oldest_age_s(age),
        "buffer/pending": float(dict(_ok(pending, {})).get("pending", 0)),
        "buffer/prompts_depth": float(_ok(prompts, 0)),
        "buffer/dead_letter_depth": float(_ok(dead, 0)),
        "buffer/version": float(_ok(version, 0)),
    }
    for name in COUNTERS:
        out[f"buffer/{name}"] = float(counters.get(name, 0))
    # The Redis counter ``dropped_stale`` holds prompt-born groups only (it frees admission slots); the
    # metric is every stale drop, with the environment-born share beside it.
    out["buffer/dropped_stale"] += out["buffer/dropped_stale_env"]

    lags = {int(k): int(v) for k, v in dict(_ok(hist, {})).items()}
    total = sum(lags.values())
    for lag, count in sorted(lags.items()):
        out[f"buffer/staleness/{lag}"] = float(count)
    out["buffer/staleness_mean"] = sum(k * v for k, v in lags.items()) / total if total else 0.0
    out["buffer/staleness_max"] = float(max((k for k, v in lags.items() if v), default=0))
    out.update(LengthBook.from_hash(str_keys(dict(_ok(lengths, {})))).metrics())
    return out
