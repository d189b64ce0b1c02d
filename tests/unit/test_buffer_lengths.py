"""Length buckets and the length book (buffer/lengths.py): exact bucket edges, a header field that parses
back, and the TV distance against a direct computation from the raw lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest

from buffer.lengths import (
    LengthBook,
    bucket,
    bucket_floor,
    bucket_label,
    clean_counts,
    encode_counts,
    parse_counts,
    tv_distance,
)


def test_buckets_are_half_octaves_with_exact_integer_edges() -> None:
    for n in range(1, 5000):
        assert bucket(n) == math.floor(2 * math.log2(n) + 1e-12) + 1, n
        assert bucket_floor(bucket(n)) <= n < bucket_floor(bucket(n) + 1), n
    assert bucket(0) == 0
    assert [bucket_label(bucket(n)) for n in (1, 2, 3, 5, 7, 11, 15, 22, 31, 256)] == [
        "1", "2", "3", "4-5", "6-7", "8-11", "12-15", "16-22", "23-31", "256-362",
    ]  # fmt: skip


def test_a_header_field_parses_back_and_garbage_reads_as_empty() -> None:
    lengths = [1, 4, 5, 5, 100, 256]
    raw = encode_counts(lengths)
    counts, tokens = parse_counts(raw)
    assert tokens == sum(lengths)
    assert counts == {bucket(1): 1, bucket(4): 3, bucket(100): 1, bucket(256): 1}
    assert clean_counts(raw) == raw
    for bad in ("x:1", "3:-1", "-2:1", "3", "3:1:2", "tokens:5"):
        assert clean_counts(bad) == "", bad


@pytest.mark.parametrize("seed", range(5))
def test_tv_distance_matches_a_direct_computation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    generated = np.minimum(256, (4 / rng.random(400)).astype(int))  # Pareto-like lengths from 4
    kept = generated[rng.random(400) < np.where(generated > 40, 0.3, 0.95)]  # long ones dropped more
    bg = np.array([bucket(int(n)) for n in generated])
    bk = np.array([bucket(int(n)) for n in kept])
    edges = sorted(set(bg))
    direct = 0.5 * sum(abs((bg == b).mean() - (bk == b).mean()) for b in edges)
    hist = lambda arr: {int(b): int((arr == b).sum()) for b in set(arr)}  # noqa: E731
    assert tv_distance(hist(bg), hist(bk)) == pytest.approx(direct)
    assert direct > 0.05  # the skew this is meant to show is visible at this size


def test_the_book_reads_the_settle_scripts_fields() -> None:
    raw = {"acknowledged:5": "3", "acknowledged:tokens": "13", "dropped_stale:17": "2",
           "dropped_stale:tokens": "512", "dead_letter:5": "1", "dead_letter:tokens": "4"}  # fmt: skip
    book = LengthBook.from_hash(raw)
    assert book.generated() == {5: 4, 17: 2}
    assert book.trained() == {5: 3}
    assert book.tv() == pytest.approx(0.5 * (abs(4 / 6 - 1) + 2 / 6))
    assert book.mean() == pytest.approx((13 + 512 + 4) / 6)
    assert book.mean("acknowledged") == pytest.approx(13 / 3)
    m = book.metrics()
    assert m["buffer/length_drop_rate/256-362"] == 1.0
    assert m["buffer/length_drop_rate/4-5"] == pytest.approx(0.25)
    table = "\n".join(book.table())
    assert "dropped_stale" in table and "256-362" in table and "100.0%" in table
