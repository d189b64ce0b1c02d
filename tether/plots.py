"""Training curves as a PNG in the run folder, drawn from ``metrics.jsonl``.

Evaluation rows (``val/...``, see ``learner.evaluation``) are their own rows at the step they evaluated,
so each key is plotted from the rows that have it; a run without evaluation simply has no such panel.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tether.metrics import read_metrics

DEFAULT_KEYS = (
    "reward/mean",
    "val/mean@k",
    "val/pass@k",
    "loss/total",
    "loss/pg",
    "actor/entropy",
    "buffer/staleness_mean",
)


def plot_metrics(metrics_path: str | Path, out_png: str | Path, keys: Sequence[str] = DEFAULT_KEYS) -> Path | None:
    """One panel per key that has at least one value; returns the PNG path, or None if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    series = {key: [(r["step"], r[key]) for r in rows if r.get(key) is not None] for key in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.4 * len(series)), sharex=True, squeeze=False)
    for ax, (key, points) in zip(axes[:, 0], series.items(), strict=True):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="." if len(points) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("learner step")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
