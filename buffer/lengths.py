"""Completion lengths of the groups the buffer settles, per counter, so a run can show whether what it
trained on has the length distribution of what was generated.

Under a staleness bound the long completions are the ones that arrive late: if the bound drops them, the
learner trains on a distribution skewed short (docs/STALENESS.md). Every trajectories entry carries its
completions' lengths in its header (field ``l``, :func:`encode_counts`), so the settle script books them
with whatever counter the entry ends in — ``acknowledged``, ``dropped_stale``, ``dead_letter`` … — into one
hash (``RedisKeys.lengths``: field ``<counter>:<bucket>`` -> completions, ``<counter>:tokens`` -> their
tokens), even for a stale group whose payload is never fetched. Generated = everything settled; trained =
``acknowledged``. Buckets are half octaves (lengths 1, 2, 3, 4–5, 6–7, 8–11, 12–15, 16–22, 23–31, …):
fine enough that a tail lost past 100 tokens shows, coarse enough for few fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TRAINED = "acknowledged"
TOKENS = "tokens"


def bucket(length: int) -> int:
    """The half-octave bucket of a length: 0 for 0, else ``floor(2·log2(length)) + 1`` (exact, in integers)."""
    return (length * length).bit_length() if length > 0 else 0


def bucket_floor(b: int) -> int:
    """The smallest length in bucket ``b``."""
    return 0 if b <= 0 else math.isqrt(2 ** (b - 1) - 1) + 1


def bucket_label(b: int) -> str:
    lo, hi = bucket_floor(b), bucket_floor(b + 1) - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


def encode_counts(lengths: Iterable[int]) -> str:
    """``"b:n,b:n,tokens:t"``: completions per bucket and their tokens, the header field a group's entry
    carries (the settle script adds each ``key:n`` to the field ``<counter>:<key>``)."""
    counts: dict[int, int] = {}
    total = 0
    for n in lengths:
        b = bucket(int(n))
        counts[b] = counts.get(b, 0) + 1
        total += int(n)
    return ",".join([*(f"{b}:{n}" for b, n in sorted(counts.items())), f"{TOKENS}:{total}"])


def parse_counts(raw: str) -> tuple[dict[int, int], int]:
    """``(completions per bucket, tokens)`` of an :func:`encode_counts` field; a malformed one (an entry
    written by hand) reads as empty."""
    out: dict[int, int] = {}
    tokens = 0
    try:
        for part in filter(None, raw.split(",")):
            key, n = part.split(":")
            if int(n) < 0:
                return {}, 0
            if key == TOKENS:
                tokens += int(n)
            elif int(key) >= 0:
                out[int(key)] = out.get(int(key), 0) + int(n)
            else:
                return {}, 0
    except ValueError:
        return {}, 0
    return out, tokens


def clean_counts(raw: str) -> str:
    """The field as the settle script may book it: re-encoded from what parses, "" for anything else."""
    counts, tokens = parse_counts(raw)
    if not counts:
        return ""
    return ",".join([*(f"{b}:{n}" for b, n in sorted(counts.items())), f"{TOKENS}:{tokens}"])


def tv_distance(p: Mapping[int, int], q: Mapping[int, int]) -> float:
    """Total-variation distance between two histograms (each normalised); 0 when either is empty."""
    sp, sq = sum(p.values()), sum(q.values())
    if not sp or not sq:
        return 0.0
    return 0.5 * sum(abs(p.get(b, 0) / sp - q.get(b, 0) / sq) for b in set(p) | set(q))


@dataclass
class LengthBook:
    """The ``lengths`` hash read back: per counter, completions per bucket and their tokens."""

    counts: dict[str, dict[int, int]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_hash(cls, raw: Mapping[str, str | int]) -> LengthBook:
        book = cls()
        for key, value in raw.items():
            counter, _, b = str(key).rpartition(":")
            if not counter:
                continue
            if b == TOKENS:
                book.tokens[counter] = book.tokens.get(counter, 0) + int(value)
            elif b.isdigit():
                book.counts.setdefault(counter, {})[int(b)] = int(value)
        return book

    def generated(self) -> dict[int, int]:
        """Every settled completion, whatever its counter."""
        out: dict[int, int] = {}
        for hist in self.counts.values():
            for b, n in hist.items():
                out[b] = out.get(b, 0) + n
        return out

    def trained(self) -> dict[int, int]:
        return dict(self.counts.get(TRAINED, {}))

    def dropped(self) -> dict[str, dict[int, int]]:
        """Per counter other than ``acknowledged``: its completions per bucket."""
        return {c: dict(h) for c, h in self.counts.items() if c != TRAINED and sum(h.values())}

    def tv(self) -> float:
        """TV distance between the generated and the trained length distributions."""
        return tv_distance(self.generated(), self.trained())

    def mean(self, which: str = "") -> float:
        """Mean completion length trained (``acknowledged``) or, with ``which=""``, generated."""
        if which:
            n, tokens = sum(self.counts.get(which, {}).values()), self.tokens.get(which, 0)
        else:
            n, tokens = sum(sum(h.values()) for h in self.counts.values()), sum(self.tokens.values())
        return tokens / n if n else 0.0

    def metrics(self) -> dict[str, float]:
        """Flat ``buffer/length...`` metrics: the TV distance, the means, and per bucket the share dropped."""
        generated = self.generated()
        if not generated:
            return {}
        trained = self.trained()
        out = {
            "buffer/length_tv": self.tv(),
            "buffer/length_mean_generated": self.mean(),
            "buffer/length_mean_trained": self.mean(TRAINED),
        }
        for b, n in sorted(generated.items()):
            out[f"buffer/length_drop_rate/{bucket_label(b)}"] = 1.0 - trained.get(b, 0) / n
        return out

    def table(self) -> list[str]:
        """Per bucket: generated, trained, dropped by counter and the drop rate — ``tether status``'s lines."""
        generated = self.generated()
        if not generated:
            return []
        trained, dropped = self.trained(), self.dropped()
        counters = sorted(dropped)
        head = f"  {'length':>9} {'generated':>9} {'trained':>8} " + " ".join(f"{c:>17}" for c in counters)
        lines = [
            f"completion lengths: TV(generated, trained) {self.tv():.3f}   mean generated {self.mean():.1f}   "
            f"trained {self.mean(TRAINED):.1f} tokens",
            head + f" {'drop rate':>9}",
        ]
        for b, n in sorted(generated.items()):
            cols = " ".join(f"{dropped[c].get(b, 0):>17}" for c in counters)
            rate = 1.0 - trained.get(b, 0) / n
            lines.append(f"  {bucket_label(b):>9} {n:>9} {trained.get(b, 0):>8} {cols} {rate:>9.1%}")
        return lines
