"""The viewer's page: one self-contained HTML file (inline style, script and data; nothing fetched, so it
opens offline, from a file or from ``tether view``'s server alike).

:func:`run_data` reads the run folder — the sampled groups (``generations.jsonl``), the dead letters
(``dead_letters.jsonl``), the dead-letter counters of ``buffer_stats.json`` — and decodes token ids with
the run's tokenizer (:mod:`tether.commands.viewer.tokens`): each prompt as text, and a table of the text of every
distinct completion token, which the page looks tokens up in. :func:`render` puts it in the page; the
page's script (:mod:`tether.commands.viewer.page_script`) draws the groups, the filters (step, reward, data source)
and the colouring (policy version or behaviour log-prob), and keeps them in the URL fragment
(``#step=3&source=gsm8k&rmin=0.5&color=logprob``), so a link opens on the same view.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
from pathlib import Path
from typing import Any

from tether.commands.viewer.page_script import SCRIPT
from tether.commands.viewer.tokens import Decoder, find_decoder, model_path
from tether.records import DEAD_LETTERS, GENERATIONS, read_records


def _ids(rec: dict, key: str) -> list[int]:
    value = rec.get(key)
    return [int(i) for i in value] if isinstance(value, list) else []


def run_data(run_dir: Path, *, decoder: Decoder | None, note: str = "") -> dict[str, Any]:
    """What the page shows of ``run_dir``, as one JSON-able object."""
    groups, bad = read_records(run_dir / GENERATIONS)
    dead, bad_dead = read_records(run_dir / DEAD_LETTERS)
    every = [rec["every"] for rec in groups if isinstance(rec.get("every"), int)]
    completion_ids: set[int] = set()
    for rec in (*groups, *dead):
        for s in rec.get("samples") or []:
            completion_ids.update(_ids(s, "ids"))
        prompt = _ids(rec, "prompt")
        if prompt and not rec.get("prompt_text"):
            rec["prompt_text"] = decoder.text(prompt) if decoder else " ".join(map(str, prompt))
        rec.pop("prompt", None)  # shown as text; the ids would double the page
    pieces = decoder.pieces(completion_ids) if decoder else {}
    return {
        "run": run_dir.name,
        "folder": str(run_dir),
        "made": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": model_path(run_dir),
        "tokenizer": note,
        "every": max(every) if every else None,
        "groups": groups,
        "dead": dead,
        "unreadable_lines": bad + bad_dead,
        "dead_counts": _dead_counts(run_dir),
        "lengths": _lengths_line(run_dir),
        "pieces": {str(k): v for k, v in pieces.items()},
    }


def _books(run_dir: Path) -> dict[str, Any]:
    """The buffer's books at the learner's end (``buffer_stats.json``); empty when there are none."""
    try:
        stats = json.loads((run_dir / "buffer_stats.json").read_text())
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


def _dead_counts(run_dir: Path) -> dict[str, int]:
    """The dead-letter counters of the buffer's books at the learner's end, when there are books."""
    stats = _books(run_dir)
    counts = {k: int(v) for k, v in sorted(stats.items()) if "dead_letter" in k and isinstance(v, int | float)}
    return counts if any(counts.values()) else {}


def _lengths_line(run_dir: Path) -> str:
    """Whether the run trained on the completion lengths it generated (:mod:`buffer.lengths`), in words."""
    stats = _books(run_dir)
    if "buffer/length_tv" not in stats:
        return ""
    rates = {k.rsplit("/", 1)[1]: v for k, v in stats.items() if k.startswith("buffer/length_drop_rate/") and v}
    ordered = sorted(rates.items(), key=lambda kv: int(kv[0].split("-")[0]))
    dropped = ", ".join(f"{label} tokens {rate:.0%}" for label, rate in ordered)
    return (
        f"lengths: TV(generated, trained) {stats['buffer/length_tv']:.3f}, mean "
        f"{stats.get('buffer/length_mean_generated', 0):.1f} generated / "
        f"{stats.get('buffer/length_mean_trained', 0):.1f} trained tokens"
        + (f", not trained: {dropped}" if dropped else "")
    )


def _embed(data: dict) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``<`` can close the element."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def render(data: dict[str, Any]) -> str:
    title = html.escape(f"tether view · {data.get('run', '')}")
    return (
        PAGE.replace("{title}", title)
        .replace("{style}", STYLE)
        .replace("{script}", SCRIPT)
        .replace("{data}", _embed(data))
    )


def build_page(run_dir: Path, *, tokenizer: str | None = None) -> str:
    """The page for ``run_dir`` (the tokenizer: ``model.path`` of its config unless given)."""
    decoder, note = find_decoder(run_dir, tokenizer=tokenizer)
    return render(run_data(run_dir, decoder=decoder, note=note))


STYLE = """
:root { font-family: system-ui, sans-serif; font-size: 14px; color: #1d1d1f; background: #f6f6f4; }
body { margin: 0; }
header { position: sticky; top: 0; z-index: 2; background: #fff; border-bottom: 1px solid #ddd; padding: 8px 16px; }
h1 { font-size: 16px; margin: 0 0 4px 0; }
#summary { color: #555; margin-bottom: 6px; }
#filters { display: flex; flex-wrap: wrap; gap: 6px 16px; align-items: center; }
#filters label { white-space: nowrap; }
#filters input[type=number] { width: 5.5em; }
#legend { display: flex; gap: 6px; align-items: center; margin-top: 6px; color: #555; }
#legend span.tok { padding: 0 5px; }
main { padding: 12px 16px; }
.group, .dead { background: #fff; border: 1px solid #ddd; border-radius: 6px; margin-bottom: 12px; padding: 8px 12px; }
.dead { border-color: #e0a0a0; background: #fff8f8; }
.ghead { display: flex; flex-wrap: wrap; gap: 4px 14px; color: #444; margin-bottom: 6px; }
.ghead b { color: #000; }
.reason { color: #a00; font-weight: 600; }
.context { color: #555; font-size: 12px; margin-bottom: 4px; }
pre.prompt { background: #f1f3f7; padding: 6px 8px; margin: 0 0 6px 0; white-space: pre-wrap; word-break: break-word; }
table { border-collapse: collapse; width: 100%; }
th { text-align: left; font-weight: 600; color: #555; font-size: 12px; border-bottom: 1px solid #ddd; }
td { vertical-align: top; padding: 3px 6px; border-bottom: 1px solid #eee; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.completion { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; width: 70%; }
span.tok { border-radius: 2px; }
span.tok.masked { opacity: 0.45; text-decoration: underline dotted; }
.empty { color: #777; padding: 20px; }
h2 { font-size: 14px; margin: 18px 0 8px 0; }
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <div id="summary"></div>
  <div id="filters">
    <span>step <button id="prev" title="previous step">&#9664;</button><select id="step"
      aria-label="step"></select><button id="next" title="next step">&#9654;</button></span>
    <label>reward &ge; <input id="rmin" type="number" step="any"></label>
    <label>&le; <input id="rmax" type="number" step="any"></label>
    <label>data source <select id="source"></select></label>
    <label>colour tokens by
      <select id="color"><option value="version">policy version</option>
      <option value="logprob">behaviour log-prob</option></select></label>
    <label><input id="dead" type="checkbox" checked> dead letters</label>
  </div>
  <div id="legend"></div>
</header>
<main id="main"></main>
<script type="application/json" id="data">{data}</script>
<script>{script}</script>
</body>
</html>
"""
