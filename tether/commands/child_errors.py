"""A child's own last error line, read from its log: what ``tether up`` prints when a child dies.

The learner runs under torchrun, so its log ends with torchrun's ``ChildFailedError`` banner (a traceback of
torchrun itself, then "Root Cause ... rank : 0 ... To enable traceback see ..."), which says that a rank
failed but not why; the why is the rank's own traceback higher up (torch prefixes its lines ``[rank0]:``).
:func:`last_error` returns, in this order: the last line a child printed on purpose as it stopped
(``learner: error: the run cannot train ...``, ``learner: <a config error>``), else the final
``SomeError: message`` line of the last traceback of the failing rank (the banner's root-cause rank when there
is a banner), never torchrun's own.
:func:`same_error` compares two such lines with what differs between two lives of one failure (timestamps,
pids, addresses, ports: every number) taken out, so the supervisor can tell a child that fails the same way
at every start from one that crashed for a new reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

READ_BYTES = 1 << 20
"""Of a life's log, the last this many bytes are read (a traceback and torchrun's banner fit many times)."""
MAX_CHARS = 1000
"""A longer error line is cut (a tensor or a whole config printed into a message)."""

_RANK = re.compile(r"^\[rank(\d+)\]:\s?")
# What a child prints on purpose when it stops: ``learner: error: ...``, ``learner: <config error>``.
_OWN = re.compile(r"^(?:learner: (?:error: )?|[a-z][a-z_-]*: error: )(.+)$")
_TORCHRUN = ("torch.distributed.elastic.",)
# torchrun's agent logs ("E1128 09:32:46.780000 7108 torch/distributed/elastic/...] failed (exitcode: 1) ...")
_ELASTIC_LOG = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ torch/distributed/")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


@dataclass(frozen=True)
class Traceback:
    rank: int | None  # torch's ``[rankN]:`` prefix, None for a process not under torchrun
    error: str  # its final line: ``RuntimeError: ...``
    first: int  # the line numbers it spans (header to error line)
    last: int


def read_life(path: Path, offset: int = 0) -> str:
    """The text ``path`` gained after ``offset`` (this life of a child that appends to one log), at most
    :data:`READ_BYTES` of its end."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(offset, size - READ_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tracebacks(lines: list[str]) -> list[Traceback]:
    """Every Python traceback in ``lines``: a ``Traceback (most recent call last):`` header, indented frames,
    and the first line that is not indented (the exception). A chained exception is a traceback of its own."""
    found, start = [], None
    current_rank: int | None = None
    for i, raw in enumerate(lines):
        rank, line = _split_rank(raw)
        if line.startswith("Traceback (most recent call last):"):
            start, current_rank = i, rank
            continue
        if start is None or rank != current_rank:
            continue  # another rank's line interleaved, or no traceback open
        if line.startswith((" ", "\t")) or not line.strip():
            continue
        found.append(Traceback(rank, line.strip()[:MAX_CHARS], start, i))
        start = None
    return found


def root_cause_rank(lines: list[str]) -> int | None:
    """The rank torchrun's banner names under "Root Cause (first observed failure)", if there is a banner."""
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            for after in lines[i + 1 : i + 8]:
                m = _ROOT_RANK.match(after)
                if m:
                    return int(m.group(1))
    return None


def last_error(text: str) -> str | None:
    """The child's own last error line in ``text`` (one life's log), or None when it left none (a SIGKILL)."""
    lines = text.splitlines()
    own = [m.group(1).strip() for m in (_OWN.match(_split_rank(line)[1]) for line in lines) if m]
    if own:
        return own[-1][:MAX_CHARS]
    theirs = [t for t in tracebacks(lines) if not t.error.startswith(_TORCHRUN)]
    if not theirs:
        return None
    root = root_cause_rank(lines)
    of_root = [t for t in theirs if t.rank == root]
    return (of_root or theirs)[-1].error


def without_banner(text: str) -> list[str]:
    """``text``'s lines less torchrun's own: its agent's log lines, and its traceback and banner (from the
    traceback that ends in a ``torch.distributed.elastic`` error to the banner's closing rule)."""
    lines = text.splitlines()
    drop: set[int] = set()
    for t in tracebacks(lines):
        if t.error.startswith(_TORCHRUN):
            end = t.last
            rules = [j for j in range(t.last + 1, min(len(lines), t.last + 60)) if lines[j].startswith("=====")]
            if len(rules) >= 2:
                end = rules[1]
            drop.update(range(t.first, end + 1))
    return [line for i, line in enumerate(lines) if i not in drop and not _ELASTIC_LOG.match(line)]


def normalised(error: str) -> str:
    """``error`` with what differs between two lives of the same failure taken out: every number (timestamps,
    pids, ports, sizes) and hex address, and runs of spaces."""
    error = re.sub(r"0x[0-9a-fA-F]+", "0x_", error)
    error = re.sub(r"\d+", "N", error)
    return " ".join(error.split())


def same_error(a: str | None, b: str | None) -> bool:
    """Whether two lives ended with the same error line (one without an error line matches nothing)."""
    return a is not None and b is not None and normalised(a) == normalised(b)


def _split_rank(line: str) -> tuple[int | None, str]:
    m = _RANK.match(line)
    return (int(m.group(1)), line[m.end() :]) if m else (None, line)
