"""``tether trace``: two processes' span files become one valid Chrome trace (both pids, sorted events,
microseconds from the first span), the rotated file and a cut-off line included."""

from __future__ import annotations

import json
from pathlib import Path

from tether import spans
from tether.commands.cli import main
from tether.commands.trace import merge_spans


def _write(folder: Path, name: str, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / name).open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _span(name: str, start: float, dur: float, track: str = "MainThread", **args: object) -> dict:
    return {"name": name, "start": start, "dur": dur, "track": track, "parent": None, "args": args}


def test_two_processes_one_trace(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "spans"
    t0 = 1_700_000_000.0
    _write(folder, "rollout-0.jsonl", [_span("generate", t0 + 0.010, 0.050, "worker-0", n=8),
                                       _span("reward", t0 + 0.060, 0.005, "worker-0")])  # fmt: skip
    _write(folder, "learner-rank0.jsonl", [_span("train_step", t0 + 0.070, 0.020, step=1)])
    _write(folder, "learner-rank0.1.jsonl", [_span("wait_data", t0, 0.070, step=1)])  # rotated: older
    (folder / "rollout-0.jsonl").open("a").write('{"name": "cut off mid-wri')
    trace = merge_spans(folder)
    json.loads(json.dumps(trace))  # plain JSON all the way down
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"]: e["pid"] for e in meta if e["name"] == "process_name"}
    assert names == {"learner-rank0": 1, "rollout-0": 2}  # learner first
    assert [e["name"] for e in events] == ["wait_data", "generate", "reward", "train_step"]
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    first, gen = events[0], events[1]
    assert first["ts"] == 0 and first["dur"] == 70_000  # µs from the first span
    assert gen["ts"] == 10_000 and gen["dur"] == 50_000 and gen["pid"] == 2 and gen["args"] == {"n": 8}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads[(2, gen["tid"])] == "worker-0"
    assert trace["otherData"]["clock_origin_unix_s"] == t0
    assert trace["otherData"]["unreadable_lines"] == 1


def test_recorded_spans_through_the_command(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    for process in ("learner-rank0", "rollout-0"):
        spans.start(run / "spans", process=process, flush_s=60)
        with spans.span("outer"), spans.span("inner"):
            pass
        spans.stop()
    assert main(["trace", str(run)]) == 0
    assert "2 processes" in capsys.readouterr().out
    trace = json.loads((run / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {1, 2}
    for pid in (1, 2):
        outer, inner = (next(e for e in events if e["pid"] == pid and e["name"] == n) for n in ("outer", "inner"))
        assert outer["tid"] == inner["tid"] and inner["args"]["parent"] == "outer"
        assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1


def test_no_spans_says_so(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["trace", str(tmp_path)]) == 2
    assert "run.trace" in capsys.readouterr().err


def test_the_timeline_page_draws_a_bar_per_span_nested_under_its_parent(tmp_path: Path) -> None:
    import re

    from tether.commands.viewer.timeline import timeline_html

    folder = tmp_path / "run" / "spans"
    t0 = 1_700_000_000.0
    _write(folder, "learner-rank0.jsonl", [_span("train_step", t0, 0.5), _span("forward", t0 + 0.1, 0.2)])
    _write(folder, "rollout-0.jsonl", [_span("generate", t0 + 0.2, 0.3, "worker-0"), _span("<b>", t0 + 0.6, 0.1)])
    trace = merge_spans(folder)
    assert main(["trace", str(tmp_path / "run"), "--html", str(tmp_path / "t.html")]) == 0
    page = (tmp_path / "t.html").read_text()
    rects = re.findall(r'<rect x="([\d.]+)" y="(\d+)" width="([\d.]+)"', page)
    assert len(rects) == 4
    (x_step, y_step, w_step), (x_fwd, y_fwd, w_fwd) = rects[0], rects[1]
    assert y_fwd > y_step  # nested: drawn a level below its parent
    assert float(x_step) < float(x_fwd) and float(x_fwd) + float(w_fwd) < float(x_step) + float(w_step)
    assert "learner-rank0 · MainThread" in page and "rollout-0 · worker-0" in page
    assert "<b>" not in page.split("<svg")[1]  # names are escaped
    # a window keeps the spans that end inside it
    late = timeline_html(trace, title="t", window_s=0.15)
    assert len(re.findall("<rect", late)) == 1 and "&lt;b&gt;" in late
