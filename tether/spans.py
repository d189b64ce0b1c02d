"""One timeline across processes: every process records its stage spans with the wall clock.

    spans.start(paths.spans, process="rollout-0")        # once, at process start (``run.trace``)
    with spans.span("reward_call", address="127.0.0.1:50070"):
        ...

A span is a name, a start (``time.time()``, so spans of separate processes on one host line up; the clock
is per host), a duration, a track (the thread's name, or what :func:`set_track` set for this thread or
asyncio task) and a few arguments. Finished spans are buffered in memory and appended as JSON lines to
``{run}/spans/<process>.jsonl`` by a background thread once a second; ``tether trace`` merges the files
into one Chrome trace (:mod:`tether.commands.trace`).

The same thread rewrites ``{run}/spans/<process>.open.json`` every flush: the spans started and not yet
ended, and when it was written. That is what the watchdog reads to name the stage that is stuck (a span
open for long) or the process that stopped answering (a file no longer rewritten).

Shaped for the hot path: entering and leaving a span is two clock reads, a context-variable set/reset and
a dict insert/pop (the GIL makes those atomic, so threads need no lock); with tracing off :func:`span`
returns one shared no-op object. Like other telemetry it is best-effort: the buffer is bounded (spans
beyond it are counted, not kept), the file is rotated at ``max_bytes`` (one older file kept), and a
failing write warns once and turns recording off. Nothing here ever raises into the caller.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from tether.logs import get_logger

log = get_logger(__name__)

MAX_BYTES = 64 * 2**20
"""Default size of a process' span file before it is rotated to ``<process>.1.jsonl`` (one older kept)."""

MAX_PENDING = 100_000
"""Finished spans held between flushes at most; more are dropped and counted (``dropped`` in the file)."""

_track: contextvars.ContextVar[str | None] = contextvars.ContextVar("tether_span_track", default=None)
_parent: contextvars.ContextVar[str | None] = contextvars.ContextVar("tether_span_parent", default=None)


class Recorder:
    """One process' spans: the open ones, the finished ones waiting for the next flush, the flusher."""

    def __init__(self, folder: Path, *, process: str, max_bytes: int = MAX_BYTES, flush_s: float = 1.0,
                 max_pending: int = MAX_PENDING) -> None:  # fmt: skip
        self.folder, self.process = Path(folder), process
        self.path = self.folder / f"{process}.jsonl"
        self.open_path = self.folder / f"{process}.open.json"
        self.max_bytes, self.flush_s, self.max_pending = max_bytes, flush_s, max_pending
        self.enabled = True
        self.dropped = 0
        self.open: dict[int, tuple[str, float, str, dict[str, Any]]] = {}
        self._done: list[tuple[str, float, float, str, str | None, dict[str, Any]]] = []
        self._lock = threading.Lock()  # one flush at a time (the flusher and close)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="span-flush", daemon=True)
        self._thread.start()

    def finished(self, name: str, start: float, dur: float, track: str, parent: str | None, args: dict) -> None:
        if len(self._done) >= self.max_pending:
            self.dropped += 1
            return
        self._done.append((name, start, dur, track, parent, args))

    def flush(self) -> None:
        """Append the finished spans, rewrite the open ones; on an OS error warn once and stop recording."""
        with self._lock:
            if not self.enabled:
                return
            done, self._done = self._done, []
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if done:
                    self._append(done)
                self._write_open()
            except (OSError, TypeError, ValueError) as e:
                self.enabled = False
                self.open.clear()
                log.warning("spans_disabled", path=str(self.path), error=repr(e))

    def _append(self, done: list) -> None:
        rows = ({"name": n, "start": round(s, 6), "dur": round(d, 6), "track": t, "parent": p, "args": a}
                for n, s, d, t, p, a in done)  # fmt: skip
        lines = "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in rows)
        if self.path.exists() and self.path.stat().st_size + len(lines) > self.max_bytes:
            os.replace(self.path, self.folder / f"{self.process}.1.jsonl")  # the one older file kept
        with self.path.open("a", encoding="utf-8") as f:
            f.write(lines)

    def _write_open(self) -> None:
        now = time.time()
        spans = [
            {"name": n, "start": s, "track": t, "args": a}
            for n, s, t, a in list(self.open.values())  # a copy: threads add and remove meanwhile
        ]
        doc = {"process": self.process, "pid": os.getpid(), "updated": now, "dropped": self.dropped, "open": spans}
        tmp = self.open_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, default=str), encoding="utf-8")
        os.replace(tmp, self.open_path)

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def close(self) -> None:
        """Stop the flusher and write what is left; the open file goes (nothing of this process is open)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.open.clear()
        self.flush()
        if self.enabled:
            with contextlib.suppress(OSError):
                self.open_path.unlink(missing_ok=True)


class _Span:
    __slots__ = ("args", "name", "rec", "start", "token", "track")

    def __init__(self, rec: Recorder, name: str, args: dict[str, Any]) -> None:
        self.rec, self.name, self.args = rec, name, args

    def __enter__(self) -> _Span:
        rec = self.rec
        self.track = _track.get() or threading.current_thread().name
        self.start = time.time()
        self.token = _parent.set(self.name)
        if rec.enabled:
            rec.open[id(self)] = (self.name, self.start, self.track, self.args)
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.time()
        rec = self.rec
        with contextlib.suppress(ValueError):  # left in another context than entered (moved across tasks)
            _parent.reset(self.token)
        rec.open.pop(id(self), None)
        if rec.enabled:
            rec.finished(self.name, self.start, end - self.start, self.track, _parent.get(), self.args)


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()
_recorder: Recorder | None = None


def span(name: str, **args: Any) -> _Span | _NoSpan:
    """A context manager recording ``name`` from enter to exit (with ``args``); a no-op when tracing is off."""
    rec = _recorder
    if rec is None or not rec.enabled:
        return _NO_SPAN
    return _Span(rec, name, args)


def set_track(name: str) -> None:
    """Name the track of this thread's (or asyncio task's) later spans: coroutines sharing one thread each
    get a track of their own, so their spans nest as they run rather than interleave."""
    _track.set(name)


def start(folder: Path, *, process: str, enabled: bool = True, max_bytes: int = MAX_BYTES,
          flush_s: float = 1.0) -> Recorder | None:  # fmt: skip
    """Record this process' spans into ``folder`` (``{run}/spans``) until :func:`stop`; None when off."""
    global _recorder
    stop()
    if not enabled:
        return None
    _recorder = Recorder(folder, process=process, max_bytes=max_bytes, flush_s=flush_s)
    return _recorder


def stop() -> None:
    """Write what is left and stop recording (safe to call twice, or without :func:`start`)."""
    global _recorder
    rec, _recorder = _recorder, None
    if rec is not None:
        rec.close()


def recording() -> bool:
    return _recorder is not None and _recorder.enabled
