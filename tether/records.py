"""The run folder's sampled records for the viewer (`tether view`): two files, each with a hard cap on its size.

    runs/<id>/generations.jsonl   a sample of the groups the learner trained on: one JSON line per group
    runs/<id>/dead_letters.jsonl  the newest dead-lettered groups and prompts, with their reasons

Neither ever grows without bound. The generations file is *thinned*, not cut: when the next step's lines
would take it over its cap, the lines of every other logged step go (those whose step is not a multiple
of twice the current interval) and the interval doubles. The file then spans the whole run at the finest
spacing that fits — step 3 and step 3000 both stay readable, which keeping the last N would not give —
and a thinning happens about log2(steps) times in a run. The dead letters keep their newest half when
full: a recent failure's reason matters more than an old one's. Both rewrite through a temporary file and
``os.replace``, so a reader, or a crash halfway, never sees half a file.

Every generations line starts ``{"step": N, "every": K`` (K the interval it was logged at), so thinning reads
no JSON and a resumed learner continues at the interval the file had reached.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

GENERATIONS = "generations.jsonl"
DEAD_LETTERS = "dead_letters.jsonl"
DEAD_LETTER_SHARE = 4
"""The dead letters' file may hold a quarter of the generations cap."""

_HEAD = re.compile(rb'^\{"step":\s*(\d+),\s*"every":\s*(\d+)')


class RecordTooLarge(ValueError):
    """One step's lines alone are more than half the cap: they cannot be kept."""


def _rewrite(path: Path, lines: Iterable[bytes]) -> int:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        for line in lines:
            f.write(line)
        size = f.tell()
    os.replace(tmp, path)
    return size


def _lines(path: Path) -> list[bytes]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    # A line cut by a crash mid-write has no newline: dropped here, and never kept by a rewrite.
    return [ln + b"\n" for ln in data.split(b"\n")[:-1] if ln]


def _last_line(path: Path, *, block: int = 1 << 16) -> bytes:
    """The file's last complete line without its newline (b"" when none), read from the end."""
    try:
        with path.open("rb") as f:
            pos = f.seek(0, os.SEEK_END)
            tail = b""
            while pos > 0:
                size = min(block, pos)
                pos -= size
                f.seek(pos)
                tail = f.read(size) + tail
                end = tail.rfind(b"\n")  # what follows the last newline is a cut line: not a record
                if end < 0:
                    continue
                start = tail.rfind(b"\n", 0, end)
                if start >= 0 or pos == 0:
                    return tail[start + 1 : end]
            return b""
    except FileNotFoundError:
        return b""


class GenerationsFile:
    """Appends a step's group lines while the step is due (a multiple of :attr:`every`), thinning the file
    to stay within ``max_bytes``."""

    def __init__(self, path: Path, *, max_bytes: int, every: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self.every = every
        head = _HEAD.match(_last_line(path))
        if head:  # a resumed run keeps the interval its file had reached
            self.every = max(every, int(head.group(2)))
        self.size = path.stat().st_size if path.exists() else 0
        self.thinned = 0
        """Thinnings this object made."""

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def append(self, step: int, records: list[dict]) -> bool:
        """Write ``records`` (JSON objects) as step ``step``'s lines; False when the step is not due (also
        when the thinning this write needed made it no longer due). :class:`RecordTooLarge` when they alone
        are over half the cap."""
        if not records or not self.due(step):
            return False
        data = b"".join(self._line(step, r) for r in records)
        if len(data) > self.max_bytes // 2:
            raise RecordTooLarge(f"step {step}'s {len(records)} groups take {len(data)} bytes, over half the cap "
                                 f"of {self.max_bytes} bytes")  # fmt: skip
        while self.size and self.size + len(data) > self.max_bytes:
            self._thin()
        if not self.due(step):
            return False
        with self.path.open("ab") as f:
            f.write(data)
        self.size += len(data)
        return True

    def _line(self, step: int, record: dict) -> bytes:
        body = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        head = f'{{"step":{step},"every":{self.every}'
        return (head + ("," + body[1:] if body != "{}" else "}")).encode() + b"\n"

    def _thin(self) -> None:
        """Double the interval and keep only the lines of steps that are multiples of it (repeated by the
        caller until the new lines fit: every pass halves what it keeps, and a pass with an interval past
        the last step keeps nothing)."""
        self.every *= 2
        kept = []
        for line in _lines(self.path):
            head = _HEAD.match(line)
            if head and int(head.group(1)) % self.every == 0:
                kept.append(line)
        self.size = _rewrite(self.path, kept)
        self.thinned += 1


class NewestFile:
    """Appends lines; when the next ones would take the file over ``max_bytes``, keeps the newest lines
    that fill half of it."""

    def __init__(self, path: Path, *, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self.size = path.stat().st_size if path.exists() else 0

    def last(self) -> dict | None:
        """The newest record, or None."""
        line = _last_line(self.path)
        try:
            return json.loads(line) if line else None
        except ValueError:
            return None

    def append(self, records: list[dict]) -> int:
        """Write ``records``; a line over half the cap is left out, and of more than half a file at once only
        the newest lines that fill half. Returns the lines written."""
        lines = [json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" for r in records]
        lines = [ln for ln in lines if len(ln) <= self.max_bytes // 2]
        while sum(map(len, lines)) > self.max_bytes // 2:
            lines.pop(0)
        data = b"".join(lines)
        if not data:
            return 0
        if self.size + len(data) > self.max_bytes:
            keep, room = [], self.max_bytes // 2 - len(data)
            for line in reversed(_lines(self.path)):
                room -= len(line)
                if room < 0:
                    break
                keep.append(line)
            self.size = _rewrite(self.path, reversed(keep))
        with self.path.open("ab") as f:
            f.write(data)
        self.size += len(data)
        return len(lines)


def read_records(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of a JSON-lines file and the count of lines that were not one (a line cut by a
    crash, a hand edit); no file: nothing."""
    out, bad = [], 0
    for line in _lines(path):
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad += 1
    return out, bad
