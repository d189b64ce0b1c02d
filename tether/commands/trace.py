"""``tether trace runs/<id>``: the run's stage spans, every process on one timeline.

Each process of a run appends its spans to ``{run}/spans/<process>.jsonl`` (:mod:`tether.spans`); this
merges them into one Chrome trace (the JSON object format with ``traceEvents``) that Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open: a process row per learner rank and rollout server,
a track per thread or prompt worker, a complete (``ph: "X"``) event per span, so overlap and bubbles show.

Times are the processes' wall clocks (``time.time()``): on one host they line up exactly; across hosts
they are as close as the hosts' clocks are (NTP: typically well under a millisecond). The trace starts at
the run's first span (its Unix time is ``otherData.clock_origin_unix_s``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tether.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="one Chrome/Perfetto timeline of a run's stage spans, all processes")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (runs/<id>)")
    p.add_argument("--out", metavar="FILE", default=None, help="where to write the trace (default RUN_DIR/trace.json)")
    p.add_argument("--html", metavar="FILE", default=None, help="also draw it as one self-contained page (SVG)")
    p.add_argument("--window-s", type=float, default=None, metavar="S", help="--html: only the last S seconds")


def cmd_trace(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"trace: unexpected arguments {' '.join(overrides)}")
    run = Path(args.run_dir)
    folder = run / "spans"
    if not folder.is_dir():
        raise ConfigError(f"trace: {folder}: no spans (a run records them with run.trace: true, the default)")
    trace = merge_spans(folder)
    out = Path(args.out) if args.out else run / "trace.json"
    out.write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
    meta = trace["otherData"]
    print(f"wrote {meta['spans']} spans of {len(meta['processes'])} processes ({', '.join(meta['processes'])}) "
          f"to {out} — open it in https://ui.perfetto.dev or chrome://tracing")  # fmt: skip
    if args.html:
        from tether.commands.viewer.timeline import timeline_html

        Path(args.html).write_text(timeline_html(trace, title=f"tether trace · {run.name}", window_s=args.window_s))
        print(f"wrote the timeline page {args.html}")
    if meta["unreadable_lines"]:
        print(f"tether: warning: {meta['unreadable_lines']} unreadable span lines skipped (a process cut off "
              "mid-write)")  # fmt: skip
    return 0


def _process_order(name: str) -> tuple[int, str]:
    """Learner ranks first, then rollout servers, then anything else; by name within each."""
    return (0 if name.startswith("learner") else 1 if name.startswith("rollout") else 2, name)


def read_spans(folder: Path) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Each process' spans (its rotated older file first) and how many lines could not be read."""
    files: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        stem = path.name[: -len(".jsonl")]
        process, rotated = (stem[: -len(".1")], True) if stem.endswith(".1") else (stem, False)
        files.setdefault(process, []).insert(0 if rotated else len(files.get(process, [])), path)
    out: dict[str, list[dict[str, Any]]] = {}
    bad = 0
    for process, paths in files.items():
        rows = out.setdefault(process, [])
        for path in paths:
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                    float(row["start"]), float(row["dur"]), str(row["name"])
                except (ValueError, KeyError, TypeError):
                    bad += 1
                    continue
                rows.append(row)
    return out, bad


def merge_spans(folder: Path) -> dict[str, Any]:
    """The Chrome trace of every ``<process>.jsonl`` in ``folder``: a pid per process, a tid per track,
    events sorted by start, times and durations in microseconds from the first span (whole ones: a double
    holding a Unix time resolves a quarter of a microsecond)."""
    by_process, bad = read_spans(folder)
    processes = sorted(by_process, key=_process_order)
    origin = min((float(r["start"]) for rows in by_process.values() for r in rows), default=0.0)
    meta: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for pid, process in enumerate(processes, start=1):
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tids: dict[str, int] = {}
        for row in by_process[process]:
            track = str(row.get("track") or "main")
            tid = tids.get(track)
            if tid is None:
                tid = tids[track] = len(tids) + 1
                meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
            args = dict(row.get("args") or {})
            if row.get("parent"):
                args["parent"] = row["parent"]
            events.append({
                "name": str(row["name"]), "cat": process.split("-")[0], "ph": "X", "pid": pid, "tid": tid,
                "ts": round((float(row["start"]) - origin) * 1e6), "dur": round(float(row["dur"]) * 1e6, 1),
                "args": args,
            })  # fmt: skip
    # By start; at one start the longer (enclosing) span first, so viewers nest them the right way round.
    events.sort(key=lambda e: (e["ts"], -e["dur"]))
    other = {"clock_origin_unix_s": origin, "processes": processes, "spans": len(events), "unreadable_lines": bad}
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}
