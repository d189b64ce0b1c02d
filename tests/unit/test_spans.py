"""The span recorder (:mod:`tether.spans`): spans nest, threads and asyncio tasks record without losing
one, the buffer and the file stay bounded, a failing write warns once and stops, the open spans are seen."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether import spans


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "spans"
    spans.stop()


def _rows(folder: Path, process: str = "p") -> list[dict]:
    return [json.loads(line) for line in (folder / f"{process}.jsonl").read_text().splitlines()]


def test_off_records_nothing(folder: Path) -> None:
    assert spans.start(folder, process="p", enabled=False) is None
    with spans.span("x", a=1) as s:
        assert s is spans.span("y")  # the one shared no-op
    spans.stop()
    assert not folder.exists()


def test_spans_nest(folder: Path) -> None:
    spans.start(folder, process="p", flush_s=60)
    with spans.span("step", step=1):
        with spans.span("forward", rows=2):
            pass
        with spans.span("backward"):
            pass
    spans.stop()
    rows = {r["name"]: r for r in _rows(folder)}
    outer, inner = rows["step"], rows["forward"]
    assert outer["args"] == {"step": 1} and inner["args"] == {"rows": 2}
    assert inner["parent"] == "step" and rows["backward"]["parent"] == "step" and outer["parent"] is None
    assert outer["start"] <= inner["start"] and inner["start"] + inner["dur"] <= outer["start"] + outer["dur"] + 1e-6
    assert inner["track"] == outer["track"] == threading.current_thread().name
    assert not (folder / "p.open.json").exists()  # nothing open once the process stops recording


def test_threads_lose_nothing(folder: Path) -> None:
    spans.start(folder, process="p", flush_s=0.01)  # flushing all the while

    def work(i: int) -> None:
        for j in range(500):
            with spans.span("w", i=i, j=j):
                pass

    threads = [threading.Thread(target=work, args=(i,), name=f"t{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.stop()
    rows = _rows(folder)
    assert len(rows) == 8 * 500
    assert {(r["args"]["i"], r["args"]["j"]) for r in rows} == {(i, j) for i in range(8) for j in range(500)}
    assert {r["track"] for r in rows} == {f"t{i}" for i in range(8)}


def test_asyncio_tasks_get_their_own_tracks(folder: Path) -> None:
    spans.start(folder, process="p", flush_s=60)

    async def worker(i: int) -> None:
        spans.set_track(f"worker-{i}")
        for _ in range(3):
            with spans.span("generate"):
                await asyncio.sleep(0.001)
                with spans.span("reward"):
                    await asyncio.sleep(0.001)

    async def main() -> None:
        await asyncio.gather(*(worker(i) for i in range(3)))

    asyncio.run(main())
    spans.stop()
    rows = _rows(folder)
    assert {r["track"] for r in rows} == {"worker-0", "worker-1", "worker-2"}
    # interleaved on one thread, yet each reward's parent is its own task's generate
    assert all(r["parent"] == "generate" for r in rows if r["name"] == "reward")


def test_open_spans_are_written(folder: Path) -> None:
    spans.start(folder, process="rollout-1", flush_s=0.02)
    with spans.span("reward_call", address="127.0.0.1:50070"):
        deadline = 0
        while not (folder / "rollout-1.open.json").exists() and deadline < 200:
            threading.Event().wait(0.01)
            deadline += 1
        threading.Event().wait(0.05)
        doc = json.loads((folder / "rollout-1.open.json").read_text())
    assert doc["process"] == "rollout-1" and doc["updated"] >= doc["open"][0]["start"]
    assert [(s["name"], s["args"]) for s in doc["open"]] == [("reward_call", {"address": "127.0.0.1:50070"})]
    threading.Event().wait(0.1)
    assert json.loads((folder / "rollout-1.open.json").read_text())["open"] == []


def test_pending_is_bounded(folder: Path) -> None:
    rec = spans.start(folder, process="p", flush_s=60)
    assert rec is not None
    rec.max_pending = 100
    for _ in range(250):
        with spans.span("x"):
            pass
    assert len(rec._done) == 100 and rec.dropped == 150
    spans.stop()
    assert len(_rows(folder)) == 100


def test_file_is_rotated_and_capped(folder: Path) -> None:
    spans.start(folder, process="p", flush_s=60, max_bytes=20_000)
    rec = spans._recorder
    assert rec is not None
    for _round in range(30):
        for _ in range(50):
            with spans.span("x", pad="y" * 50):
                pass
        rec.flush()
    spans.stop()
    files = sorted(p.name for p in folder.glob("*.jsonl"))
    assert files == ["p.1.jsonl", "p.jsonl"]
    assert all((folder / f).stat().st_size <= 20_000 for f in files)  # two files of at most max_bytes


def test_failing_write_warns_once_and_stops(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.write_text("a file where the folder should be")  # every write fails
    rec = spans.start(folder, process="p", flush_s=60)
    assert rec is not None
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with spans.span("x"):
                pass
            rec.flush()
    warnings = [r for r in caplog.records if "spans_disabled" in r.getMessage()]
    assert len(warnings) == 1
    assert not rec.enabled and not spans.recording()
    with spans.span("after"):  # recording is off: the no-op, and nothing piles up
        pass
    assert rec._done == [] and rec.open == {}
    spans.stop()  # closing a disabled recorder raises nothing
