"""``bench/common.py`` states a figure one way and ``bench/report.py`` turns the figures into JSON and a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report as bench_report
from bench.common import figure, ordered, report


def test_a_figure_is_the_median_of_its_repeats_with_their_min_max() -> None:
    f = figure("x/y", [0.9, 0.7, 1.2], goal=0.8, direction="min", baseline="raw")
    assert (f.ratio, f.spread, f.repeats, f.met) == (0.9, (0.7, 1.2), 3, True)
    assert figure("x/y", [1.3, 1.2, 1.0], goal=1.1, direction="max", baseline="b").met is False
    assert figure("x/y", [1.0], goal=None, direction="min", baseline="b").met is None
    with pytest.raises(ValueError, match="direction"):
        figure("x/y", [1.0], goal=1.0, direction="up", baseline="b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no repeats"):
        figure("x/y", [], goal=1.0, direction="min", baseline="b")


def test_the_order_alternates_so_each_side_goes_first() -> None:
    assert [ordered(["a", "b"], k)[0] for k in range(4)] == ["a", "b", "a", "b"]
    assert [ordered(["a", "b", "c"], k)[0] for k in range(3)] == ["a", "b", "c"]


def test_report_appends_json_lines_and_report_py_writes_json_and_markdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = tmp_path / "figures.jsonl"
    monkeypatch.setenv("TETHER_BENCH_RESULTS", str(lines))
    report(figure("buffer/1K_tokens", [0.5, 0.6, 0.55], goal=0.8, direction="min", baseline="raw XADD"))
    report(figure("load/rss", [1.0, 1.01, 1.02], goal=1.1, direction="max", baseline="RSS before"), quick=True)
    report(figure("buffer/1K_tokens", [0.85, 0.9, 0.8], goal=0.8, direction="min", baseline="raw XADD"))  # rerun
    assert "FIGURE buffer/1K_tokens: 0.550" in capsys.readouterr().out
    out_json, out_md = tmp_path / "results.json", tmp_path / "results.md"
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{bench_report.START}\nold table\n{bench_report.END}\nafter\n")
    args = [str(lines), "--json", str(out_json), "--md", str(out_md), "--readme", str(readme)]
    assert bench_report.main(args) == 0
    figures = json.loads(out_json.read_text())
    assert [f["name"] for f in figures] == ["load/rss", "buffer/1K_tokens"]  # the last run of a name wins
    keys = {"name", "ratio", "spread", "goal", "direction", "baseline", "repeats", "met"}
    assert all(keys <= set(f) for f in figures)
    assert figures[1]["ratio"] == 0.85 and figures[1]["spread"] == [0.8, 0.9] and figures[1]["met"] is True
    md = out_md.read_text()
    assert "| `buffer/1K_tokens` | 0.85 | 0.80–0.90 (min-max) | 3 | ≥ 0.8 | yes | raw XADD |" in md
    assert "| `load/rss` | 1.01 | 1.00–1.02 (min-max) | 3 | ≤ 1.1 | yes | RSS before (**--quick smoke run" in md
    assert figures[0]["quick"] is True and figures[1]["quick"] is False
    assert readme.read_text() == f"# x\n{bench_report.START}\n{md}{bench_report.END}\nafter\n"  # the same table
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        bench_report.main(args)
