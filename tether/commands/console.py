"""What ``tether up`` prints while a run goes and when it ends, wherever its output goes.

On a terminal: one self-overwriting line, refreshed about once a second from Redis. Anywhere else — a
file, a pipe, CI, ``nohup``, compose logs — carriage returns would pile up, so the console prints one
plain line every ``every_steps`` learner steps instead, read from the run's ``metrics.jsonl`` so that each
line is an exact step (the first and the last of this lifetime always among them), plus the live line
every ``quiet_every_s`` while no step arrives (so a stuck run still says what it is doing). In both
modes a failure that stops training (:class:`buffer.health.RunWatch`, an unreachable Redis) is a
``tether: warning:`` line of its own, and every ending closes with :func:`summary_lines`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer import RedisKeys
from buffer.health import RunWatch
from tether.commands.snapshot import RunSnapshot, fmt, recent_staleness
from tether.commands.watchdog import Watchdog
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.redis_server import connect_redis, redacted
from tether.runs import RunPaths

log = get_logger(__name__)

REDIS_GRACE_TICKS = 3
"""Failed Redis reads in a row before the console says Redis is unreachable (one blip is not news)."""


def step_interval(total_steps: int, *, lines: int = 15) -> int:
    """A round number of steps (1, 2, 5, 10, 20, 50, ...) giving at most about ``lines`` step lines."""
    n = 1
    while total_steps / n > lines:
        for factor in (2, 2.5, 2):  # 1 → 2 → 5 → 10 → 20 → 50 ...
            n = int(n * factor)
            if total_steps / n <= lines:
                break
    return n


class GenRate:
    """Generated tokens per second (the buffer's ``tokens`` counter, which every engine feeds through the
    servers' trajectory writer) over a trailing window of at least ``min_window_s`` and at least the last
    whole learner step, at most ``max_window_s``.

    The counter moves in bursts: a group is written when its last sample finishes, and an engine that
    generates a batch at a time writes its groups together. The console used to divide the last second's
    difference, and a step line is printed in the second the learner's row lands — while it trains on
    groups written earlier — so with learner steps over a second long every step line read ``gen 0 tok/s``
    (a whole run of a 270M model on the transformers engine)."""

    def __init__(self, *, min_window_s: float = 30.0, max_window_s: float = 600.0) -> None:
        self.min_window_s, self.max_window_s = min_window_s, max_window_s
        self._points: deque[tuple[float, float]] = deque()  # (monotonic time, tokens)
        self._steps: deque[tuple[float, str]] = deque(maxlen=3)  # when each of the last steps was first seen

    def add(self, now: float, tokens: float, step: str) -> float | None:
        """Record a reading; the rate over the window ending now (None until there are two readings)."""
        if not self._steps or self._steps[-1][1] != step:
            self._steps.append((now, step))
        self._points.append((now, tokens))
        while self._points and self._points[0][0] < now - self.max_window_s:
            self._points.popleft()
        window = self.min_window_s
        if len(self._steps) >= 3:  # from the start of the step before the last one: a whole step, at least
            window = max(window, now - self._steps[-3][0])
        base = self._points[0]
        for point in self._points:  # the newest reading at least ``window`` old, else the oldest there is
            if point[0] > now - window:
                break
            base = point
        if now <= base[0]:
            return None
        return max(0.0, tokens - base[1]) / (now - base[0])


class ProgressLine:
    """The console of ``tether up``; ``update()`` about once a second, ``finish()`` once. Never raises."""

    def __init__(
        self,
        cfg: TetherConfig,
        *,
        out: TextIO | None = None,
        metrics_path: Path | None = None,
        every_steps: int | None = None,
        quiet_every_s: float = 30.0,
        watch: RunWatch | None = None,
        stall: Watchdog | None = None,
    ) -> None:
        self.cfg = cfg
        self.keys = RedisKeys(cfg.run.run_id or "")
        self.out = out or sys.stdout
        self.tty = _isatty(self.out)
        self.every = every_steps or step_interval(cfg.learner.total_steps)
        self.quiet_every_s = quiet_every_s
        self.watch = watch
        self.stall = stall  # no learner step for too long: name the stuck stage (tether/commands/watchdog.py)
        self.metrics_path = metrics_path
        # Rows already in the file belong to earlier lifetimes of a resumed run.
        self._offset = metrics_path.stat().st_size if metrics_path is not None and metrics_path.exists() else 0
        self._client: redis.Redis | None = None
        self._last: RunSnapshot | None = None
        self._gen = GenRate()
        self._gen_rate: float | None = None
        self._width = 0
        self._last_plain = time.monotonic()
        self._printed_step: int | None = None
        self._last_row: dict[str, Any] | None = None
        self._redis_failures = 0

    def line(self) -> str:
        """The live line's text (also used by tests)."""
        try:
            if self._client is None:
                self._client = connect_redis(self.cfg.buffer.redis_url, timeout_s=0.5)
                # One try a read: a tick must not sit through the data path's retries (about a minute when
                # Redis hangs), since the launcher's loop and the watchdog's word wait for it.
                self._client.set_retry(Retry(NoBackoff(), 0))
            new = RunSnapshot(self._client, self.keys)
        except Exception:
            # Anything at all (Redis down, a half-written key): the launcher's loop must keep running.
            self._drop_client()
            self._redis_failures += 1
            return "redis: unreachable"
        self._redis_failures = 0
        old, self._last = self._last, new
        s = new.stats
        self._gen_rate = self._gen.add(new.time, new.stats["buffer/tokens"], new.learner_str("step"))
        return (
            f"step {new.learner_str('step')} | v{new.version} | "
            f"reward {fmt(new.learner_float('reward_mean'), '.3f')} | "
            f"gen {fmt(self._gen_rate, '.0f')} tok/s | "
            f"staleness {recent_staleness(new, old):.2f} | buffer {s['buffer/depth']:.0f}"
        )

    def update(self) -> None:
        with contextlib.suppress(Exception):
            stuck = self.stall.check() if self.stall is not None else None
            if stuck:  # first: it reads files only, and names a hung Redis without waiting on it
                self.warn(stuck)
            text = self.line()
            for warning in self._run_warnings():
                self.warn(warning)
            if self.tty:
                pad = max(0, self._width - len(text))
                self.out.write("\r" + text + " " * pad)
                self._width = len(text)
            else:
                self._plain(text)
            self.out.flush()

    def warn(self, message: str) -> None:
        """A warning on a line of its own (above the live line on a terminal)."""
        log.warning("run_warning", message=message)
        prefix = "\r" + " " * self._width + "\r" if self.tty and self._width else ""
        self.out.write(f"{prefix}tether: warning: {message}\n")
        self._width = 0
        self.out.flush()

    def finish(self) -> None:
        """The steps not yet shown (always the last one), then end the live line."""
        with contextlib.suppress(Exception):
            if self.tty:
                if self._width:
                    self.out.write("\n")
            else:
                for row in self._new_rows():
                    self._show(row, force=False)
                last = self._last_row_in_file()  # not only what the ticks saw: the file is whole now
                if last is not None and self._printed_step != int(last["step"]):
                    self._show(last, force=True)
            self.out.flush()
        self._drop_client()

    def close(self) -> None:
        self.finish()

    def _run_warnings(self) -> list[str]:
        if self._redis_failures == REDIS_GRACE_TICKS:
            return [
                f"Redis at {redacted(self.cfg.buffer.redis_url)} is unreachable, so no data moves — check that it "
                "runs there and buffer.redis_url (empty means the embedded one, which tether up starts itself)"
            ]
        if self.watch is None or self._client is None:
            return []
        try:
            return self.watch.check(self._client)
        except redis.RedisError:
            return []

    def _plain(self, text: str) -> None:
        shown = False
        for row in self._new_rows():
            shown |= self._show(row, force=False)
        if not shown and time.monotonic() - self._last_plain >= self.quiet_every_s:
            self.out.write(text + "\n")
            self._last_plain = time.monotonic()

    def _show(self, row: dict[str, Any], *, force: bool) -> bool:
        step = int(row["step"])
        first = self._printed_step is None
        self._last_row = row
        if not (force or first or step % self.every == 0 or step >= self.cfg.learner.total_steps):
            return False
        self.out.write(self._row_line(row) + "\n")
        self._printed_step = step
        self._last_plain = time.monotonic()
        return True

    def _row_line(self, row: dict[str, Any]) -> str:
        version = row.get("learner/version")
        depth = self._last.stats["buffer/depth"] if self._last is not None else None
        return (
            f"step {row['step']}/{self.cfg.learner.total_steps} | v{fmt(version, '.0f')} | "
            f"reward {fmt(row.get('reward/mean'), '.3f')} | gen {fmt(self._gen_rate, '.0f')} tok/s | "
            f"staleness {fmt(row.get('staleness/mean'), '.2f')} | buffer {fmt(depth, '.0f')}"
        )

    def _new_rows(self) -> list[dict[str, Any]]:
        """Training rows appended to metrics.jsonl since the last call (whole lines only)."""
        if self.metrics_path is None or not self.metrics_path.exists():
            return []
        with self.metrics_path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        rows = []
        for raw in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(raw)
                if row.get("reward/mean") is not None:
                    rows.append(row)
        return rows

    def _last_row_in_file(self) -> dict[str, Any] | None:
        """The last training row of metrics.jsonl, read whole (the run has ended, so nothing is half-written)."""
        if self.metrics_path is None or not self.metrics_path.exists():
            return self._last_row
        last = self._last_row
        for raw in self.metrics_path.read_bytes().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(raw)
                if row.get("reward/mean") is not None and (last is None or row["step"] >= last["step"]):
                    last = row
        return last

    def _drop_client(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._client = None


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def summary_lines(
    cfg: TetherConfig,
    paths: RunPaths,
    *,
    outcome: str,
    started: float,
    error: tuple[str, str | None] | None = None,
) -> list[str]:
    """The run in a few lines: how it ended, steps, reward first → last, samples/s, wall time, where things
    are. ``started`` is the wall-clock start of this lifetime (earlier lifetimes' rows are not counted);
    ``error``: the child that ended a failed run and its own last error line."""
    wall = time.time() - started
    rows = _rows_since(paths.metrics, started)
    head = f"run {cfg.run.run_id} {outcome} after {_duration(wall)}"
    lines = []
    if not rows:
        lines.append(f"{head}, before its first learner step")
    else:
        first, last = rows[0], rows[-1]
        steps = f"{first['step']} → {last['step']}"
        lines.append(f"{head}: {len(rows)} learner steps ({steps} of {cfg.learner.total_steps})")
        rewards = [r["reward/mean"] for r in rows]
        tail = rewards[-10:]
        lines.append(
            f"reward {rewards[0]:.3f} → {rewards[-1]:.3f} (step {steps}; best {max(rewards):.3f}, "
            f"mean of the last {len(tail)} {sum(tail) / len(tail):.3f})"
        )
        samples = sum(_samples(r, cfg.rollout.n) for r in rows)
        span = last["time"] - first["time"] + (first.get("timing/step") or 0.0)
        speed = f"{samples / span:.1f} samples/s" if span > 0 else "- samples/s"
        stale = [r["staleness/mean"] for r in rows if r.get("staleness/mean") is not None]
        mean_stale = f", staleness mean {sum(stale) / len(stale):.2f}" if stale else ""
        lines.append(f"throughput {speed} trained ({samples:.0f} samples in {_duration(span)} of training{mean_stale})")
    if error is not None and error[1]:
        lines.insert(1, f"{error[0]}'s last error: {error[1]}")
    lines.append(f"run folder {paths.root}")
    for label, path in (
        ("plot", paths.plots / "curves.png"),
        ("books", paths.root / "buffer_stats.json"),
        ("metrics", paths.metrics),
    ):
        if path.exists():
            lines.append(f"  {label:<8} {path}")
    lines.append(f"  {'logs':<8} {paths.logs}/")
    return lines


def _samples(row: dict[str, Any], n: int) -> float:
    """Trained samples of a step: the learner's count (episodes' groups vary in size), else groups × n."""
    if row.get("learner/samples") is not None:
        return row["learner/samples"]
    return (row.get("data/groups") or 0) * n


def _rows_since(path: Path, started: float) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    from tether.metrics import read_metrics

    return [r for r in read_metrics(path) if r.get("reward/mean") is not None and r.get("time", 0) >= started]


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
