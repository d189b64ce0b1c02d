"""The watchdog: when no learner step completes for too long, name the stage that is stuck and its process.

A run is *stalled* when no learner step has completed for ``K`` × the median of the recent steps' times
(:data:`K` = 5, over the last :data:`WINDOW` steps), and at least :data:`FLOOR_S` (30 s) — before a
lifetime's first two steps (no step time known yet), :data:`FIRST_STEP_S` (300 s: loading models counts).
Step times come from the run's ``metrics.jsonl`` (each row's ``time``), so the watchdog needs neither Redis
nor the learner to answer. ``run.watchdog_k`` and ``run.watchdog_floor_s`` set K and the floor.

What is stuck comes from the open spans every process rewrites once a second
(``{run}/spans/<process>.open.json``, :mod:`tether.spans`), in this order:

1. a process whose file stopped being rewritten (stopped, hung in C code without the GIL, or killed
   without cleaning up): "rollout-1: not responding for 45 s (open then: generate)";
2. the longest-open innermost span of each track that is doing something (a reward call, generation, a
   weight-sync stage): "rollout-1: reward call to 127.0.0.1:50070 open for 45 s";
3. the longest-open span that only waits on another part (``wait_data``, ``wait_stale``,
   ``weight_sync_wait``, ``buffer_put``): "learner-rank0: wait data open for 45 s".

``tether up`` prints the finding as a ``tether: warning:`` line once per stall, and again when what is stuck
changes (a server that hangs becomes silent a few seconds later); ``tether status`` shows it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

K = 5.0
"""A stall is K × the median recent step time without a step..."""
FLOOR_S = 30.0
"""... and never less than this many seconds."""
FIRST_STEP_S = 300.0
"""Before a lifetime's first step (models load, servers warm up) the wait allowed is this."""
WINDOW = 20
"""Recent steps whose times make the median."""
SILENT_S = 5.0
"""A process whose open-spans file is older than this is not responding (its flusher writes every second)."""
WAITS = frozenset({"wait_data", "wait_stale", "weight_sync_wait", "buffer_put"})
"""Spans that wait on another part of the run: named only when nothing else is open."""


def describe(name: str, args: dict[str, Any]) -> str:
    """``reward_call`` with an address → "reward call to 127.0.0.1:50070"; a commit → "... waiting on ..."."""
    text = name.replace("_", " ")
    if args.get("address"):
        text += f" to {args['address']}"
    if isinstance(args.get("servers"), str) and args["servers"]:
        text += f" waiting on {args['servers']}"
    return text


def read_open(folder: Path) -> list[dict[str, Any]]:
    """Every process' open-spans document (unreadable or half-written ones are skipped)."""
    docs = []
    for path in sorted(folder.glob("*.open.json")):
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and "updated" in doc:
                docs.append(doc)
    return docs


def stuck_stage(folder: Path, *, now: float | None = None, min_age_s: float = 0.0) -> str | None:
    """The stage (and its process) most likely holding the run up, from the open spans; None if none is."""
    now = time.time() if now is None else now
    docs = read_open(folder)
    silent = [(now - float(d["updated"]), d) for d in docs if now - float(d["updated"]) > SILENT_S]
    if silent:
        age, doc = max(silent, key=lambda x: x[0])
        innermost = _innermost(doc)
        then = f" (open then: {', '.join(describe(s['name'], s.get('args') or {}) for s in innermost)})"
        return f"{doc['process']}: not responding for {age:.0f} s{then if innermost else ''}"
    candidates = []
    for doc in docs:
        for s in _innermost(doc):
            age = now - float(s["start"])
            if age >= min_age_s:
                candidates.append((s["name"] in WAITS, -age, doc["process"], s))
    if not candidates:
        return None
    _, neg_age, process, s = min(candidates, key=lambda c: (c[0], c[1]))
    return f"{process}: {describe(s['name'], s.get('args') or {})} open for {-neg_age:.0f} s"


def _innermost(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per track, the open span that started last (the one the track is inside of now)."""
    last: dict[str, dict[str, Any]] = {}
    for s in doc.get("open") or []:
        track = str(s.get("track"))
        if track not in last or float(s["start"]) >= float(last[track]["start"]):
            last[track] = s
    return list(last.values())


class Watchdog:
    """Reads ``metrics.jsonl`` as it grows; :meth:`check` says what is stuck once a stall begins."""

    def __init__(self, run: Path, *, k: float = K, floor_s: float = FLOOR_S, first_step_s: float = FIRST_STEP_S,
                 since: float | None = None) -> None:  # fmt: skip
        self.metrics, self.spans = run / "metrics.jsonl", run / "spans"
        self.k, self.floor_s, self.first_step_s = k, floor_s, first_step_s
        self.since = time.time() if since is None else since  # this lifetime's start
        self.step_times: list[float] = []  # completion times (Unix) of this lifetime's steps, the recent ones
        self._offset = 0
        self._warned: tuple[float, str] | None = None  # (last step time, what was stuck) of the last warning

    def _read(self) -> None:
        if not self.metrics.exists():
            return
        with self.metrics.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for raw in data[:end].splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                t = float(json.loads(raw)["time"])
                if t >= self.since and (not self.step_times or t > self.step_times[-1]):
                    self.step_times.append(t)
        del self.step_times[: -WINDOW - 1]

    def limit_s(self) -> float:
        """Seconds without a step that count as a stall now."""
        gaps = [b - a for a, b in zip(self.step_times, self.step_times[1:], strict=False)]
        if not gaps:  # no step time known yet
            return max(self.floor_s, self.first_step_s)
        return max(self.floor_s, self.k * statistics.median(gaps))

    def stalled(self, now: float | None = None) -> float | None:
        """Seconds since the last step (or the start) when that is past :meth:`limit_s`; else None."""
        now = time.time() if now is None else now
        self._read()
        last = self.step_times[-1] if self.step_times else self.since
        waited = now - last
        return waited if waited > self.limit_s() else None

    def check(self, now: float | None = None) -> str | None:
        """Once per stall: "no learner step for N s (limit L s): <the stuck stage>"; None otherwise."""
        now = time.time() if now is None else now
        waited = self.stalled(now)
        last = self.step_times[-1] if self.step_times else self.since
        if waited is None:
            return None
        stage = stuck_stage(self.spans, now=now) or "no stage is open (is tracing on? run.trace)"
        what = stage.split(" for ")[0]  # the process and stage, not how long
        if self._warned == (last, what):
            return None
        self._warned = (last, what)
        return f"no learner step for {waited:.0f} s (limit {self.limit_s():.0f} s): {stage}"
