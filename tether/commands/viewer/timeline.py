"""A run's timeline as one self-contained HTML page (``tether trace RUN --html FILE``): an SVG row per track.

The Chrome trace that ``tether trace`` writes is what Perfetto opens; this draws the same events where no
trace viewer is at hand (offline, or a screenshot for a report): one row per process and track (learner
ranks first, then rollout servers), one bar per span, nested spans stacked below their parent, coloured by
span name, with the name and duration on hover. ``window_s`` keeps the last that many seconds (a long run's
whole timeline has more bars than a page draws comfortably).
"""

from __future__ import annotations

import hashlib
import html
from typing import Any

ROW_LEVEL_PX = 14
LABEL_PX = 190
WIDTH_PX = 1400


def _colour(name: str) -> str:
    hue = int(hashlib.md5(name.encode()).hexdigest()[:4], 16) % 360  # a colour, not security
    return f"hsl({hue},55%,62%)"


def _levels(events: list[dict[str, Any]]) -> list[int]:
    """Each event's nesting depth within its track (events sorted by start, enclosing ones first)."""
    depth, open_ends = [], []
    for e in events:
        start, end = e["ts"], e["ts"] + e["dur"]
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        depth.append(len(open_ends))
        open_ends.append(end)
    return depth


def timeline_html(trace: dict[str, Any], *, title: str, window_s: float | None = None) -> str:
    names: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    spans: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e["ph"] == "X":
            spans.setdefault((e["pid"], e["tid"]), []).append(e)
    end = max((e["ts"] + e["dur"] for rows in spans.values() for e in rows), default=0.0)
    start = max(0.0, end - window_s * 1e6) if window_s else 0.0
    scale = (WIDTH_PX - LABEL_PX) / max(end - start, 1.0)
    rows, y = [], 24
    for key in sorted(spans):
        events = sorted((e for e in spans[key] if e["ts"] + e["dur"] >= start), key=lambda e: (e["ts"], -e["dur"]))
        if not events:
            continue
        levels = _levels(events)
        height = (max(levels) + 1) * ROW_LEVEL_PX
        label = f"{names.get(key[0], key[0])} · {threads.get(key, key[1])}"
        rows.append(f'<text x="4" y="{y + 11}" class="l">{html.escape(label)}</text>')
        rows.append(f'<line x1="0" x2="{WIDTH_PX}" y1="{y + height + 2}" y2="{y + height + 2}" class="g"/>')
        for e, level in zip(events, levels, strict=True):
            x = LABEL_PX + max(0.0, e["ts"] - start) * scale
            w = max(0.6, (e["ts"] + e["dur"] - max(e["ts"], start)) * scale)
            tip = f"{e['name']} {e['dur'] / 1e3:.1f} ms" + "".join(
                f" {k}={v}" for k, v in (e.get("args") or {}).items() if k != "parent"
            )
            rows.append(
                f'<rect x="{x:.1f}" y="{y + level * ROW_LEVEL_PX}" width="{w:.1f}" height="{ROW_LEVEL_PX - 2}" '
                f'fill="{_colour(e["name"])}"><title>{html.escape(tip)}</title></rect>'
            )
            if w > 40:
                rows.append(f'<text x="{x + 2:.1f}" y="{y + level * ROW_LEVEL_PX + 10}" class="s">'
                            f"{html.escape(e['name'])}</text>")  # fmt: skip
        y += height + 6
    ticks = []
    span_s = (end - start) / 1e6
    step = next((s for s in (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300) if span_s / s <= 12), 600)
    t = 0.0
    while t <= span_s:
        x = LABEL_PX + t * 1e6 * scale
        ticks.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="16" y2="{y}" class="t"/>'
                     f'<text x="{x + 2:.1f}" y="12" class="s">{start / 1e6 + t:.3g} s</text>')  # fmt: skip
        t += step
    style = (".l{font:11px sans-serif}.s{font:9px sans-serif;fill:#222}.g{stroke:#ddd}.t{stroke:#eee}"
             "body{margin:8px;font:13px sans-serif}")  # fmt: skip
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><div>{html.escape(title)} — {len(rows) and sum(map(len, spans.values()))} "
        f"spans, {span_s:.2f} s shown (hover a bar for its name and duration)</div>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{y + 4}">{"".join(ticks)}'
        f"{''.join(rows)}</svg></body></html>"
    )
