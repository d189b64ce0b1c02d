"""Why a run is not training, in one line each: the signals a person would otherwise dig out of logs.

A run that trains nothing is usually one of three things, all visible in the run's Redis keys: no rollout
server has registered (none started, or all still loading), every group is dead-lettered (a reward
service that is not there, prompts too long for the model), or every group is dropped as stale (weight
updates do not reach the servers). :class:`RunWatch` compares the counters over a short window and says
which, naming the setting to check. ``tether up``'s progress tick and the learner's feed (for a learner
started by hand) both ask it; neither the watch nor its caller may fail because Redis is down — a
failed check is the caller's "Redis unreachable".

It warns only when *nothing* was trained in the window, so a healthy run with a few stale drops stays
quiet, and repeats a warning at most every ``repeat_s``.

The run's end is published here too (``run_end``): a learner that reached its last step says so, and
rollout servers started by hand idle or exit instead of waiting for prompts that never come.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

from buffer.dead_letter import ROLLOUT_DEAD_LETTER
from buffer.keys import RedisKeys
from buffer.registry import ServerRegistry
from tether.config import TetherConfig

_DEAD = ("dead_letter", "prompts_dead_letter", ROLLOUT_DEAD_LETTER)


@dataclass(frozen=True)
class _Counts:
    time: float
    trained: int
    stale: int
    dead: int


class RunWatch:
    def __init__(
        self, cfg: TetherConfig, *, no_server_after_s: float = 45.0, window_s: float = 10.0, repeat_s: float = 30.0
    ) -> None:
        self.cfg = cfg
        self.keys = RedisKeys(cfg.run.run_id or "")
        self.no_server_after_s, self.window_s, self.repeat_s = no_server_after_s, window_s, repeat_s
        self._prev: _Counts | None = None
        self._base: _Counts | None = None  # the counts just before training last moved
        self._trained_at = 0.0
        self._step_s = 0.0  # time between the last two moves of training: slow steps widen the window
        self._last_server_seen: float | None = None
        self._warned: dict[str, float] = {}

    def check(self, client: redis.Redis, *, now: float | None = None) -> list[str]:
        """The warnings due now (each one line). Raises ``redis.RedisError`` when Redis cannot be read."""
        now = time.monotonic() if now is None else now
        raw = client.hgetall(self.keys.counters)
        counters = {(k.decode() if isinstance(k, bytes) else k): int(float(v)) for k, v in raw.items()}
        cur = _Counts(now, counters.get("acknowledged", 0), counters.get("dropped_stale", 0),
                      sum(counters.get(k, 0) for k in _DEAD))  # fmt: skip
        out = []
        if self._last_server_seen is None:
            self._last_server_seen = now  # the clock starts at the first check, not at the run's start
        if ServerRegistry(client, self.keys).live():
            self._last_server_seen = now
        elif now - self._last_server_seen >= self.no_server_after_s:
            out += self._once("servers", now, self._no_server(now - self._last_server_seen))

        if self._prev is None or self._base is None:
            self._base, self._trained_at = cur, now
        elif cur.trained != self._prev.trained:
            # Groups wasted in the same tick as the last trained step count as after it: a learner that
            # trained, then found only stale groups, is stuck even though it trained a second ago.
            self._step_s, self._trained_at, self._base = now - self._trained_at, now, self._prev
        self._prev = cur
        quiet = now - self._trained_at
        if quiet < max(self.window_s, 3 * self._step_s):
            return out
        if cur.dead > self._base.dead:
            reason = _last_reason(client, self.keys)
            out += self._once("dead", now, self._dead(cur.dead - self._base.dead, quiet, reason))
        if cur.stale > self._base.stale:
            out += self._once("stale", now, self._stale(cur.stale - self._base.stale, quiet))
        return out

    def _once(self, kind: str, now: float, message: str) -> list[str]:
        last = self._warned.get(kind)
        if last is not None and now - last < self.repeat_s:
            return []
        self._warned[kind] = now
        return [message]

    def _no_server(self, waited_s: float) -> str:
        run = self.cfg.run.run_id
        return (
            f"no rollout server registered for run {run!r} in {waited_s:.0f}s, so nothing is generated — start one "
            f"(tether rollout --config CONFIG --run.run_id {run}) with the same buffer.redis_url, or check "
            "rollout.num_servers and the rollout servers' logs (a server registers once its engine has loaded)"
        )

    def _dead(self, n: int, span_s: float, reason: str) -> str:
        return f"{n} groups dead-lettered and none trained in the last {span_s:.0f}s — {_setting_for(self.cfg, reason)}"

    def _stale(self, n: int, span_s: float) -> str:
        return (
            f"{n} groups dropped as stale and none trained in the last {span_s:.0f}s: they were generated "
            f"with weights more than algorithm.max_staleness ({self.cfg.algorithm.max_staleness}) versions behind "
            "the learner — check that weight updates reach the rollout servers (weight_sync.transport, their logs), "
            "that episodes are not held open across updates, or raise algorithm.max_staleness"
        )


def _last_reason(client: redis.Redis, keys: RedisKeys) -> str:
    entries = client.xrevrange(keys.dead_letter, count=1)
    if not entries:
        return ""
    fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in entries[0][1].items()}
    reason = fields.get("reason", b"")
    return (reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)).strip()


def _setting_for(cfg: TetherConfig, reason: str) -> str:
    """The last reason, and the setting that usually causes it."""
    said = f"last reason: {reason[:200]!r}" if reason else "no reason recorded"
    reward = cfg.rollout.reward
    if "reward" in reason:
        if reward.type == "remote":
            return (
                f"{said}; the reward service at {reward.address} fails or is not running — start it, or fix "
                "rollout.reward.address (and rollout.reward.token if it requires one)"
            )
        return f"{said}; check rollout.reward ({reward.type}) and the dataset's reward fields"
    if "bad prompt" in reason or "too long" in reason:
        return f"{said}; check rollout.max_prompt_len and the dataset (learner.data_path)"
    if "delivered" in reason:
        return f"{said}; prompts are taken but never answered — rollout servers crash on them, see their logs"
    return f"{said}; see `tether status` and the dead-letter stream {RedisKeys(cfg.run.run_id or '').dead_letter}"


def publish_run_end(client: redis.Redis, keys: RedisKeys, *, step: int, version: int) -> None:
    """The learner reached its last step: rollout servers of this run may stop (``exit_when_run_ends``)."""
    client.set(keys.run_end, json.dumps({"step": step, "version": version, "time": time.time()}))


def clear_run_end(client: redis.Redis, keys: RedisKeys) -> None:
    """A learner (re)starting the run: it is not over, whatever an earlier lifetime published."""
    client.delete(keys.run_end)


def run_ended(client: redis.Redis, keys: RedisKeys) -> dict | None:
    """What :func:`publish_run_end` wrote, or None while the run goes on."""
    raw = client.get(keys.run_end)
    if raw is None:
        return None
    try:
        return dict(json.loads(raw))
    except (ValueError, TypeError):
        return {}
