"""Training curves as one PNG in the run folder (``plots/curves.png``), drawn from ``metrics.jsonl``.

Meant to be looked at rather than read: a title naming the run and its main settings, axis names in
words, the reward smoothed over its raw values (a step's reward mean is a noisy estimate from one batch),
then loss, entropy, staleness against its bound, the mean completion length generated beside the one
trained (:mod:`buffer.lengths`), throughput and — when the run evaluates — the
validation scores on a 0–1 axis (mean@k, pass@k, ...: :func:`validation_keys`). A panel appears only when it
has data, and ``loss/total`` is drawn only where it differs from ``loss/pg`` (without KL or entropy terms they
are the same curve). Both ``tether up`` and a learner started on its own write it at their end; failing to
draw never fails a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.logs import get_logger
from tether.metrics import read_metrics

log = get_logger(__name__)

LABELS = {
    "reward/mean": "reward (batch mean)",
    "loss/pg": "policy-gradient loss",
    "loss/total": "total loss",
    "loss/kl": "KL loss",
    "actor/entropy": "entropy (nats/token)",
    "staleness/mean": "staleness mean",
    "staleness/max": "staleness max",
    "perf/tokens_per_s": "learner tokens/s",
}

Rows = list[dict[str, Any]]


def smooth(values: Sequence[float], *, window: int | None = None) -> list[float]:
    """Trailing moving average (window ~ 1/10 of the run, at least 1): the trend under a noisy curve."""
    window = window or max(1, min(25, len(values) // 10))
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


@dataclass
class Panel:
    ylabel: str
    lines: list[tuple[str, list[int], list[float], dict[str, Any]]] = field(default_factory=list)
    bound: float | None = None  # a dashed horizontal line (max_staleness)
    ylim: tuple[float, float] | None = None  # widened to fit a value outside it (a reward above 1)

    def add(self, label: str, steps: list[int], values: list[float], **style: Any) -> None:
        if steps:
            self.lines.append((label, steps, values, style))


def _series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _reward(rows: Rows, _cfg) -> Panel:  # type: ignore[no-untyped-def]
    p = Panel("reward")
    steps, values = _series(rows, "reward/mean")
    p.add("per step", steps, values, color="tab:blue", alpha=0.3, linewidth=1)
    p.add("smoothed", steps, smooth(values), color="tab:blue", linewidth=2)
    return p


def _loss(rows: Rows, _cfg) -> Panel:  # type: ignore[no-untyped-def]
    p = Panel("loss")
    pg, total = _series(rows, "loss/pg"), _series(rows, "loss/total")
    if total[0] and (total[0] != pg[0] or any(abs(a - b) > 1e-9 for a, b in zip(pg[1], total[1], strict=True))):
        p.add(LABELS["loss/total"], *total)
    p.add(LABELS["loss/pg"], *pg)
    p.add(LABELS["loss/kl"], *_series(rows, "loss/kl"))
    if len(p.lines) == 1:  # one curve: its name is the axis' name
        p.ylabel = p.lines[0][0].replace(" loss", "\nloss")
    return p


def _entropy(rows: Rows, _cfg) -> Panel:  # type: ignore[no-untyped-def]
    p = Panel("entropy\n(nats/token)")
    p.add("entropy", *_series(rows, "actor/entropy"), color="tab:purple")
    return p


def _staleness(rows: Rows, cfg) -> Panel:  # type: ignore[no-untyped-def]
    p = Panel("staleness\n(versions behind)", bound=cfg.algorithm.max_staleness if cfg is not None else None)
    for key in ("staleness/mean", "staleness/max"):
        p.add(LABELS[key], *_series(rows, key), drawstyle="steps-post")
    return p


def _lengths(rows: Rows, _cfg) -> Panel:  # type: ignore[no-untyped-def]
    """Mean completion length generated beside trained (run so far): apart when a bound drops the long ones."""
    p = Panel("completion\nlength (tokens)")
    tv = _series(rows, "buffer/length_tv")[1]
    trained = f"trained (TV {tv[-1]:.2f} at the end)" if tv else "trained"
    p.add("generated", *_series(rows, "buffer/length_mean_generated"), color="tab:gray")
    p.add(trained, *_series(rows, "buffer/length_mean_trained"), color="tab:orange")
    return p


def _throughput(rows: Rows, cfg) -> Panel:  # type: ignore[no-untyped-def]
    n = cfg.rollout.n if cfg is not None else 1
    p = Panel("samples/s\n(trained)" if cfg is not None else "groups/s\n(trained)")
    points = [(r["step"], (r.get("learner/samples") or r["data/groups"] * n) / r["timing/step"]) for r in rows
              if r.get("data/groups") is not None and r.get("timing/step")]  # fmt: skip
    steps, values = [q[0] for q in points], [q[1] for q in points]
    p.add("per step", steps, values, color="tab:green", alpha=0.3, linewidth=1)
    p.add("smoothed", steps, smooth(values), color="tab:green", linewidth=2)
    return p


ACCURACY = ("mean@k", "pass@k", "pass@1", "best@k", "reward_mean")
"""The evaluation's scores (:mod:`learner.evaluation`), in legend order: shares and mean rewards, on 0–1."""
PER_SOURCE_SCORES = ("mean@k", "pass@k")
"""Of each data source, the headline scores only: five per source made a legend taller than the panel."""


def validation_keys(rows: Rows) -> list[str]:
    """The ``val/*`` keys the validation panel draws: the scores of :data:`ACCURACY`, then each data source's
    :data:`PER_SOURCE_SCORES` (``val/<source>/<score>``) when there are two sources or more (with one, they
    repeat the overall curves). Counts, latency, version and ``k`` are left out: on the same axis they
    flattened the scores into a line at the bottom."""
    order = {name: i for i, name in enumerate(ACCURACY)}
    overall, per_source = [], []
    for key in {k for r in rows for k, v in r.items() if k.startswith("val/") and v is not None}:
        source, _, score = key.removeprefix("val/").rpartition("/")  # a source may hold a slash: openai/gsm8k
        if score in (PER_SOURCE_SCORES if source else ACCURACY):
            (per_source if source else overall).append((source, order[score], key))
    keys = [k for _, _, k in sorted(overall)]
    if len({source for source, _, _ in per_source}) >= 2:
        keys += [k for _, _, k in sorted(per_source)]
    return keys


def _validation(rows: Rows, _cfg) -> Panel:  # type: ignore[no-untyped-def]
    p = Panel("validation\n(score)", ylim=(0.0, 1.0))
    for key in validation_keys(rows):
        steps, values = _series(rows, key)
        style = {"linestyle": "--", "linewidth": 1} if "/" in key.removeprefix("val/") else {}
        p.add(key.removeprefix("val/"), steps, values, marker="o", markersize=3, **style)
    return p


PANELS: tuple[Callable[..., Panel], ...] = (
    _reward,
    _loss,
    _entropy,
    _staleness,
    _lengths,
    _throughput,
    _validation,
)


def panels_for(rows: Rows, cfg=None) -> list[Panel]:  # type: ignore[no-untyped-def]
    """The panels that have data, top to bottom."""
    return [p for p in (make(rows, cfg) for make in PANELS) if p.lines]


def title_for(cfg) -> str:  # type: ignore[no-untyped-def]
    """``run <id>`` and the settings that explain a curve's shape."""
    if cfg is None:
        return "tether run"
    model = Path(cfg.model.path).name or cfg.model.path
    return (
        f"tether run {cfg.run.run_id} — {model}, {cfg.rollout.engine.type}\n"
        f"n={cfg.rollout.n}, batch {cfg.learner.train_batch_size} prompts, lr {cfg.learner.lr:g}, "
        f"max_staleness {cfg.algorithm.max_staleness}, {cfg.weight_sync.transport.type} sync"
    )


def plot_metrics(metrics_path: str | Path, out_png: str | Path, *, cfg=None) -> Path | None:  # type: ignore[no-untyped-def]
    """Draw the panels that have data; returns the PNG path, or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    panels = panels_for(rows, cfg)
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels) + 0.8), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        for label, steps, values, style in panel.lines:
            ax.plot(steps, values, label=label, **style)
        if panel.bound is not None:
            ax.axhline(panel.bound, color="gray", linestyle="--", linewidth=1, label="max_staleness")
        if panel.ylim is not None:
            values = [v for line in panel.lines for v in line[2]]
            low, high = min([panel.ylim[0], *values]), max([panel.ylim[1], *values])
            margin = 0.03 * (high - low)  # a marker at 1.0 is drawn whole
            ax.set_ylim(low - margin, high + margin)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize=7, loc="best", ncol=1 + len(ax.get_lines()) // 7)
    axes[-1, 0].set_xlabel("learner step")
    fig.suptitle(title_for(cfg), fontsize=10)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_plot(cfg, paths) -> Path | None:  # type: ignore[no-untyped-def]
    """``{run}/plots/curves.png`` from the run's metrics (best effort: a warning, never an exception)."""
    if not paths.metrics.exists():
        return None
    try:
        return plot_metrics(paths.metrics, paths.plots / "curves.png", cfg=cfg)
    except Exception as e:  # diagnostics only
        log.warning("plot_not_written", error=repr(e))
        return None
