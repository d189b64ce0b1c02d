"""The viewer's files never pass their cap: the sampled groups thin to span the whole run, the dead letters
keep their newest lines; a line cut by a crash is skipped; a resumed writer keeps the interval it reached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.records import GenerationsFile, NewestFile, RecordTooLarge, read_records


def _steps(path: Path) -> list[int]:
    return sorted({r["step"] for r in read_records(path)[0]})


@pytest.mark.parametrize("cap", [2_000, 7_777, 50_000])
def test_the_sample_never_passes_its_cap_and_spans_the_whole_run(tmp_path: Path, cap: int) -> None:
    path = tmp_path / "generations.jsonl"
    f = GenerationsFile(path, max_bytes=cap, every=1)
    for step in range(1, 1001):
        pad = "x" * (step * 7 % 150)  # lines of different lengths
        f.append(step, [{"group_id": f"g{step}-{k}", "pad": pad} for k in range(2)])
        size = path.stat().st_size if path.exists() else 0
        assert size <= cap and size == f.size
    steps = _steps(path)
    assert steps == list(range(f.every, 1001, f.every))  # every multiple of the interval reached, nothing else
    assert len(steps) >= 2 and steps[-1] > 1000 - f.every  # spread from the start to the end
    assert f.every > 1 and f.every & (f.every - 1) == 0  # doubled, from 1
    assert all(len(r) == 2 for r in _by_step(path).values())  # a step keeps all its groups or none


def _by_step(path: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in read_records(path)[0]:
        out.setdefault(r["step"], []).append(r)
    return out


def test_steps_that_are_not_due_are_not_written(tmp_path: Path) -> None:
    f = GenerationsFile(tmp_path / "g.jsonl", max_bytes=10_000, every=3)
    assert [f.append(s, [{"a": s}]) for s in range(1, 8)] == [False, False, True, False, False, True, False]
    assert _steps(f.path) == [3, 6]
    assert f.append(9, []) is False


def test_one_step_over_half_the_cap_is_refused(tmp_path: Path) -> None:
    f = GenerationsFile(tmp_path / "g.jsonl", max_bytes=1_000, every=1)
    with pytest.raises(RecordTooLarge, match="over half the cap"):
        f.append(1, [{"pad": "x" * 600}])
    assert f.append(2, [{"pad": "x" * 100}]) and _steps(f.path) == [2]


def test_a_resumed_writer_keeps_the_interval_the_file_reached(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    f = GenerationsFile(path, max_bytes=3_000, every=1)
    for step in range(1, 200):
        f.append(step, [{"pad": "y" * 50}])
    again = GenerationsFile(path, max_bytes=3_000, every=1)
    assert again.every == f.every > 1 and again.size == path.stat().st_size
    assert not again.due(f.every + 1) and again.due(4 * f.every)


def test_a_line_cut_by_a_crash_is_skipped_and_thinned_away(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    f = GenerationsFile(path, max_bytes=2_000, every=1)
    f.append(1, [{"a": 1}])
    with path.open("a") as out:
        out.write('{"step":2,"every":1,"a":')  # the learner died mid-line
    records, bad = read_records(path)
    assert [r["step"] for r in records] == [1] and bad == 0  # an unterminated line is not a record
    resumed = GenerationsFile(path, max_bytes=2_000, every=1)
    assert resumed.every == 1
    for step in range(2, 100):
        resumed.append(step, [{"pad": "z" * 40}])
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_the_dead_letters_keep_their_newest_lines_within_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "dead.jsonl"
    f = NewestFile(path, max_bytes=1_500)
    for i in range(300):
        f.append([{"id": f"{i}-0", "reason": "r" * (i % 40)}])
        assert path.stat().st_size <= 1_500
    records, _ = read_records(path)
    ids = [int(r["id"].split("-")[0]) for r in records]
    assert ids == list(range(ids[0], 300)) and len(ids) > 10  # the newest, in order, none missing
    assert f.last() == records[-1]
    assert f.append([{"id": str(i), "pad": "p" * 200} for i in range(50)]) < 50  # more than half a file at once
    assert path.stat().st_size <= 1_500 and f.last()["id"] == "49"
    assert NewestFile(path, max_bytes=1_500).size == path.stat().st_size
