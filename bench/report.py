"""Collect the figures the benchmarks appended to ``$TETHER_BENCH_RESULTS`` into a JSON list and a table.

    TETHER_BENCH_RESULTS=bench/results.jsonl python bench/buffer.py   # ... every benchmark
    python bench/report.py bench/results.jsonl                         # -> bench/results.{json,md}

Each line of the input is one figure written by :func:`bench.common.report`. When a figure name occurs
more than once (a benchmark run twice), the last one wins. ``results.json`` is a list of figures
(``name``, ``ratio``, ``spread``, ``spread_kind``, ``goal``, ``direction``, ``baseline``, ``repeats``,
``met``, ``host``, ``time``, ``note``); ``results.md`` is the same as a markdown table, and the same
table replaces what stands between the two ``bench-results`` markers of docs/BENCHMARKS.md, so that table of
figures is always this output (``--readme ''`` leaves it alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
START, END = "<!-- bench-results: start (written by bench/report.py) -->", "<!-- bench-results: end -->"


def load(path: Path) -> list[dict]:
    figures: dict[str, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"{path}:{n}: not a JSON line ({e}) — each line must come from bench.common.report"
            ) from None
        figures.pop(row["name"], None)  # re-inserted: the last run of a figure keeps its place at the end
        figures[row["name"]] = row
    return list(figures.values())


def markdown(figures: list[dict]) -> str:
    lines = [
        "| figure | ratio (median) | spread | repeats | goal | met | baseline |",
        "| --- | ---: | ---: | ---: | ---: | :---: | --- |",
    ]
    for f in figures:
        lo, hi = f["spread"]
        goal = "—" if f["goal"] is None else f"{'≥' if f['direction'] == 'min' else '≤'} {f['goal']:g}"
        met = {True: "yes", False: "**no**", None: "—"}[f["met"]]
        quick = " (**--quick smoke run, not a measurement**)" if f.get("quick") else ""
        lines.append(
            f"| `{f['name']}` | {f['ratio']:.2f} | {lo:.2f}–{hi:.2f} ({f['spread_kind']}) | {f['repeats']} "
            f"| {goal} | {met} | {f['baseline']}{quick} |"
        )
    hosts = sorted({f.get("host", "?") for f in figures})
    lines.append("")
    lines.append(f"Measured on {', '.join(hosts)}; each ratio is the median of per-repeat ratios, alternating order.")
    return "\n".join(lines) + "\n"


def into_readme(readme: Path, table: str) -> None:
    """Replace the text between the README's markers with ``table``; the markers must be there, once each."""
    text = readme.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{readme}: expected the markers {START!r} and {END!r}, once each and in that order")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{START}\n{table}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", nargs="?", type=Path, default=None, help="JSON-lines file (default $TETHER_BENCH_RESULTS)")
    p.add_argument("--json", type=Path, default=HERE / "results.json")
    p.add_argument("--md", type=Path, default=HERE / "results.md")
    p.add_argument("--readme", default=str(HERE.parent / "docs" / "BENCHMARKS.md"),
                   help="the page whose table to replace ('': none)")  # fmt: skip
    args = p.parse_args(argv)
    env = os.environ.get("TETHER_BENCH_RESULTS")
    source = args.input or (Path(env) if env else None)
    if source is None or not source.exists():
        print(f"bench/report.py: no figures file ({source or 'pass one or set TETHER_BENCH_RESULTS'})")
        return 2
    figures = load(source)
    args.json.write_text(json.dumps(figures, indent=1) + "\n")
    table = markdown(figures)
    args.md.write_text(table)
    if args.readme:
        into_readme(Path(args.readme), table)
    print(table, end="")
    missed = [f["name"] for f in figures if f["met"] is False]
    print(f"{len(figures)} figures -> {args.json}, {args.md}; below goal: {', '.join(missed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
