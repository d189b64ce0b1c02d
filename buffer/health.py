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

A run that cannot train is ended rather than left warning forever: :class:`StallWatch`, asked by the
learner's feed while it waits for groups, says so once no group the learner could train has come for
``learner.stuck_timeout_s`` while at least a step's worth were wasted (dead-lettered or dropped as stale)
and the waste goes on — with the most common reason and the setting to check. Its clock starts at the
first wasted group, never at the run's start: a model loading, servers registering or a long step are
not a stall, and neither is one burst of stale groups after a restart followed by slow fresh ones.

The run's end is published here too (``run_end``): a learner that reached its last step says so, and
rollout servers started by hand idle or exit instead of waiting for prompts that never come.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass

import redis

from buffer.dead_letter import ROLLOUT_DEAD_LETTER
from buffer.keys import RedisKeys
from buffer.ledger import read_counters
from buffer.registry import ServerRegistry
from buffer.replies import text
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
        counters = read_counters(client, self.keys)
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
        return (
            f"{n} groups dead-lettered and none trained in the last {span_s:.0f}s — {_setting_for(self.cfg, reason)}"
            f"{self._ends()}"
        )

    def _stale(self, n: int, span_s: float) -> str:
        return (
            f"{n} groups dropped as stale and none trained in the last {span_s:.0f}s: they were generated "
            f"with weights more than algorithm.max_staleness ({self.cfg.algorithm.max_staleness}) versions behind "
            f"the learner — {_STALE_ADVICE}{self._ends()}"
        )

    def _ends(self) -> str:
        stuck = self.cfg.learner.stuck_timeout_s
        return f" (the learner ends the run if this goes on for learner.stuck_timeout_s, {stuck:g}s)" if stuck else ""


class StallWatch:
    """Whether a run cannot train; the learner's feed calls :meth:`usable` for every group it can train and
    :meth:`check` every few seconds while it waits. Never raises but ``redis.RedisError``."""

    def __init__(self, cfg: TetherConfig, *, timeout_s: float, min_groups: int) -> None:
        self.cfg = cfg
        self.keys = RedisKeys(cfg.run.run_id or "")
        self.timeout_s, self.min_groups = timeout_s, max(1, min_groups)
        self.usable()

    def usable(self) -> None:
        """A group the learner can train arrived: whatever was wasted before it does not count."""
        self._base: _Waste | None = None
        self._since: float | None = None  # the first check that saw a wasted group since the base
        self._wasted, self._grew_at = 0, 0.0

    def check(self, client: redis.Redis, *, now: float | None = None) -> str | None:
        """The reason the run cannot train (one line, naming the setting to check), or None."""
        if self.timeout_s <= 0:
            return None
        now = time.monotonic() if now is None else now
        counters = read_counters(client, self.keys)
        dead, stale = sum(counters.get(k, 0) for k in _DEAD), counters.get("dropped_stale", 0)
        if self._base is None:
            last = client.xrevrange(self.keys.dead_letter, count=1)
            self._base = _Waste(dead, stale, text(last[0][0]) if last else "")
            return None
        wasted = dead - self._base.dead + stale - self._base.stale
        if wasted <= 0:
            return None
        if self._since is None:
            self._since = now
        if wasted > self._wasted:
            self._wasted, self._grew_at = wasted, now
        going_on = now - self._grew_at <= self.timeout_s / 2
        if now - self._since < self.timeout_s or wasted < self.min_groups or not going_on:
            return None
        return self._reason(client, dead - self._base.dead, stale - self._base.stale, span_s=now - self._since)

    def _reason(self, client: redis.Redis, dead: int, stale: int, *, span_s: float) -> str:
        lowest = f"({self._base.dead_letter_id}" if self._base and self._base.dead_letter_id else "-"
        entries = client.xrevrange(self.keys.dead_letter, max="+", min=lowest, count=1000) if dead else []
        reasons: Counter[str] = Counter()
        example: dict[str, str] = {}
        for _, fields in entries:
            reason = _GROUP_ID.sub("", text(_field(fields, "reason"), errors="replace").strip(), count=1)
            kind = re.sub(r"\d+", "N", reason)  # "155 tokens" and "160 tokens" are one reason
            reasons[kind] += 1
            example.setdefault(kind, reason)
        top, seen = reasons.most_common(1)[0] if reasons else ("", len(entries) or 1)
        top_dead = round(dead * seen / (len(entries) or 1))  # the stream keeps the last ~1000: a sample of them
        head = (
            f"the run cannot train: {dead + stale} groups wasted and none trained in the last {span_s:.0f}s "
            f"({dead} dead-lettered, {stale} dropped as stale)"
        )
        tail = f" (learner.stuck_timeout_s: {self.timeout_s:g}s; 0 waits instead)"
        if stale > top_dead:
            return (
                f"{head}; most common reason ({stale} of {dead + stale}): dropped as stale, generated with weights "
                f"more than algorithm.max_staleness ({self.cfg.algorithm.max_staleness}) versions behind the learner "
                f"— {_STALE_ADVICE}{tail}"
            )
        said = example.get(top, "")
        shown = f"{said[:200]!r}" if said else "no reason recorded"
        return f"{head}; most common reason ({top_dead} of {dead + stale}): {shown}; {_advice(self.cfg, said)}{tail}"


@dataclass(frozen=True)
class _Waste:
    dead: int
    stale: int
    dead_letter_id: str  # the newest dead letter when counting began ("" when none)


_GROUP_ID = re.compile(r"^\S*\d\S*: ")  # "prompt-1712345678901-0: " before a rollout server's reason
_STALE_ADVICE = (
    "check that weight updates reach the rollout servers (weight_sync.transport, their logs), that episodes "
    "are not held open across updates, or raise algorithm.max_staleness"
)


def _field(fields: dict, name: str) -> object:
    return fields.get(name.encode(), fields.get(name, b""))


def _last_reason(client: redis.Redis, keys: RedisKeys) -> str:
    entries = client.xrevrange(keys.dead_letter, count=1)
    if not entries:
        return ""
    return text(_field(entries[0][1], "reason"), errors="replace").strip()


def _setting_for(cfg: TetherConfig, reason: str) -> str:
    """The last reason, and the setting that usually causes it."""
    said = f"last reason: {reason[:200]!r}" if reason else "no reason recorded"
    return f"{said}; {_advice(cfg, reason)}"


def _advice(cfg: TetherConfig, reason: str) -> str:
    """What to check for a dead letter's reason: the setting that usually causes it."""
    reward = cfg.rollout.reward
    if "reward" in reason:
        if reward.type == "remote":
            return (
                f"the reward service at {reward.address} fails or is not running — start it, or fix "
                "rollout.reward.address (and rollout.reward.token if it requires one)"
            )
        return f"check rollout.reward ({reward.type}) and the dataset's reward fields"
    if "bad prompt" in reason or "too long" in reason or "longer than" in reason:
        return "check rollout.max_prompt_len and the dataset (learner.data_path)"
    if "delivered" in reason:
        return "prompts are taken but never answered — rollout servers crash on them, see their logs"
    return f"see `tether status` and the dead-letter stream {RedisKeys(cfg.run.run_id or '').dead_letter}"


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
