"""PNG plots of a sweep: loss curves per point, each metric against each swept parameter, the arms side by side.

Figures are drawn on matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``), never through pyplot, so
no global backend is switched and the same code runs headless in the CLI and inside a notebook kernel.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kdexp.report.model import Point, Sweep, aggregate, iter_values, short
from kdexp.report.tables import TABLE_METRICS

CURVE_METRICS = ("train/loss", "val/lm_loss", "val/kl_to_teacher", "val/top1_agreement")
_STYLE = {"finished": "-", "running": "--", "failed": ":", "diverged": ":", "pending": ":"}


def _figure(n_panels: int, width: float = 4.6, height: float = 3.4) -> tuple[Figure, list]:
    cols = min(n_panels, 3)
    rows = (n_panels + cols - 1) // cols
    fig = Figure(figsize=(width * cols, height * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n_panels)]
    return fig, axes


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _legend(fig: Figure, axes: list, n_entries: int) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:  # panels may miss a point (no val lines yet): collect every label once
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(max(1, n_entries), 3), fontsize="small")


def safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("_") or "param"


def plot_curves(sweep: Sweep, path: str | Path, metrics: tuple[str, ...] = CURVE_METRICS) -> Optional[Path]:
    """train/loss and val/* over step, one line per point (dashed: running, dotted: failed). None without curves."""
    metrics = tuple(m for m in metrics if any(p.curves.get(m) for p in sweep.points))
    if not metrics:
        return None
    fig, axes = _figure(len(metrics))
    for ax, metric in zip(axes, metrics):
        for i, p in enumerate(sweep.points):
            curve = p.curves.get(metric)
            if curve:
                steps, values = zip(*curve)
                ax.plot(steps, values, _STYLE.get(p.status, "-"), marker="o" if len(curve) < 12 else None,
                        markersize=3, color=f"C{i % 10}", label=f"{p.label} [{p.status}]"
                        if p.status != "finished" else p.label)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    _legend(fig, axes, len(sweep.points))
    return _save(fig, path)


def _combos(sweep: Sweep, points: list[Point], key: str) -> dict[str, list[Point]]:
    """Points grouped by the values of the swept keys other than ``key`` (one line / bar series each)."""
    others = [k for k in sweep.swept if k != key]
    groups: dict[str, list[Point]] = {}
    for p in points:
        label = ", ".join(f"{k}={short(p.params.get(k))}" for k in others) or "all points"
        groups.setdefault(label, []).append(p)
    return groups


def _mean_by(points: list[Point], key: str, metric: str) -> dict[Any, float]:
    """The mean per value of ``key`` (NaN when a replicate is non-finite: a gap in the line, not a dropped run)."""
    groups: dict[Any, list[Point]] = {}
    for p in points:
        groups.setdefault(p.params.get(key), []).append(p)
    means = {x: aggregate(members, metric).mean for x, members in groups.items()}
    return {x: m for x, m in means.items() if m is not None}


def plot_metric_vs_param(sweep: Sweep, key: str, path: str | Path,
                         metrics: tuple[str, ...] = TABLE_METRICS) -> Optional[Path]:
    """Each metric (finished points) against swept ``key``: a numeric key is the x axis with one line per combination
    of the other swept keys; a categorical key gives grouped bars. None when no finished point has a metric."""
    points = [p for p in sweep.finished if p.params.get(key) is not None]
    metrics = tuple(m for m in metrics if any(True for _ in iter_values(points, m)))
    if not metrics:
        return None
    numeric = sweep.is_numeric(key)
    groups = _combos(sweep, points, key)
    categories = list(dict.fromkeys(p.params.get(key) for p in points))
    fig, axes = _figure(len(metrics))
    for ax, metric in zip(axes, metrics):
        for gi, (label, members) in enumerate(groups.items()):
            means = _mean_by(members, key, metric)
            if not means:
                continue
            if numeric:
                xs = sorted(means)
                ax.plot(xs, [means[x] for x in xs], "o-", color=f"C{gi % 10}", label=label)
            else:
                width = 0.8 / len(groups)
                xs = [categories.index(c) - 0.4 + width * (gi + 0.5) for c in means]
                ax.bar(xs, list(means.values()), width=width, color=f"C{gi % 10}", label=label)
        if numeric:
            xs = [x for x in categories if x is not None]
            if min(xs) > 0 and max(xs) / min(xs) >= 100:  # lr-like sweeps span decades
                ax.set_xscale("log")
        else:
            names = [short(c) for c in categories]
            long = max(len(n) for n in names) > 10
            ax.set_xticks(range(len(categories)), names, rotation=20 if long else 0, ha="right" if long else "center",
                          rotation_mode="anchor")
        ax.set_title(metric)
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    _legend(fig, axes, len(groups))
    fig.suptitle(f"final metrics against {key}")
    return _save(fig, path)


def plot_arms(sweep: Sweep, path: str | Path, metrics: tuple[str, ...] = TABLE_METRICS) -> Optional[Path]:
    """One bar per arm for each metric (mean over the arm's finished points). None without arms."""
    arms = sweep.arms
    finished = sweep.finished
    metrics = tuple(m for m in metrics if any(True for _ in iter_values(finished, m)))
    if not arms or not metrics:
        return None
    fig, axes = _figure(len(metrics))
    for ax, metric in zip(axes, metrics):
        for i, arm in enumerate(arms):
            mean = aggregate([p for p in finished if p.arm == arm], metric).mean
            if mean is not None:  # NaN (a non-finite replicate) draws no bar; the arms table says why
                ax.bar(i, mean, color=f"C{i % 10}")
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(metric)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"arms ({sweep.arm_key})")
    return _save(fig, path)


def write_plots(sweep: Sweep, out_dir: str | Path) -> dict[str, Path]:
    """All plots of the sweep into ``out_dir``: {'curves': .., 'arms': .., 'vs <key>': ..} for those that apply.
    PNGs of an earlier report of the same dir that no longer apply are removed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("vs_*.png"), out_dir / "curves.png", out_dir / "arms.png"]:
        old.unlink(missing_ok=True)
    plots: dict[str, Optional[Path]] = {"curves": plot_curves(sweep, out_dir / "curves.png")}
    if sweep.arms:
        plots["arms"] = plot_arms(sweep, out_dir / "arms.png")
    for key in sweep.swept:
        plots[f"vs {key}"] = plot_metric_vs_param(sweep, key, out_dir / f"vs_{safe_name(key)}.png")
    return {k: v for k, v in plots.items() if v is not None}
