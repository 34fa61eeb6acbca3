"""PNG plots of a sweep: loss curves per point, each metric against each swept parameter, the arms side by side.

Figures are drawn on matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``), never through pyplot, so
no global backend is switched and the same code runs headless in the CLI and inside a notebook kernel.

Over replicates (trainer.seed swept) every finished seed is drawn (a thin curve, a dot beside a bar or a mean) under
the configuration's mean, whose band / error bars are the 95% Student-t interval of the mean, clipped to the metric's
valid range and drawn only from 3 seeds on (kdexp.report.ranges); a running replicate is its own dashed curve, never
averaged with finished ones. PNGs are written atomically: a live page never shows half a file.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import matplotlib
from matplotlib import font_manager
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import TransformNode

from kdexp.report.model import Point, Sweep, iter_values, short
from kdexp.report.ranges import clipped
from kdexp.report.replicates import Configuration, configurations, has_replicates, metric_label
from kdexp.report.stats import Summary, summarize
from kdexp.report.tables import TABLE_METRICS

CURVE_METRICS = ("train/loss", "val/lm_loss", "val/kl_to_teacher", "val/onpolicy_reverse_kl", "val/top1_agreement")
_STYLE = {"finished": "-", "running": "--", "failed": ":", "diverged": ":", "pending": ":", "interrupted": ":"}


def _figure(n_panels: int, width: float = 4.6, height: float = 3.4) -> tuple[Figure, list]:
    cols = min(n_panels, 3)
    rows = (n_panels + cols - 1) // cols
    fig = Figure(figsize=(width * cols, height * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n_panels)]
    return fig, axes


DPI = 100
KEY = "kdexp-figure"  # the PNG's tEXt chunk holding the key of the figure drawn into it


class _FigureState(pickle.Pickler):
    """Pickles a figure as its own pickling would (every artist's state: what a redraw needs), minus what differs
    between two identical figures: a transform's back-references to its parents, keyed by id()."""

    def reducer_override(self, obj):
        if isinstance(obj, TransformNode):
            return type(obj), (), {k: v for k, v in obj.__getstate__().items() if k != "_parents"}
        return NotImplemented


def figure_key(fig: Figure) -> Optional[str]:
    """A digest of everything that decides a figure's PNG: its artists' state, the rcParams read at draw time, the
    font file the default family resolves to, the dpi and matplotlib's version. Equal keys draw equal PNGs; None when
    the figure cannot be pickled."""
    buf = io.BytesIO()
    try:
        font = font_manager.findfont(font_manager.FontProperties(family=matplotlib.rcParams["font.family"]))
        _FigureState(buf, protocol=5).dump((matplotlib.__version__, DPI, font, sorted(matplotlib.rcParams.items()),
                                            fig))
    except Exception:  # noqa: BLE001 - an artist that cannot be pickled: always draw
        return None
    return hashlib.sha256(buf.getvalue()).hexdigest()


def png_key(path: Path) -> Optional[str]:
    """The figure key a PNG written by ``_save`` carries (its tEXt chunks before the image data), or None."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return None
            while True:
                head = f.read(8)
                if len(head) < 8:
                    return None
                size, kind = struct.unpack(">I4s", head)
                if kind in (b"IDAT", b"IEND"):
                    return None
                data = f.read(size + 4)[:size]  # the chunk and its CRC
                if kind == b"tEXt" and data.startswith(KEY.encode() + b"\0"):
                    return data[len(KEY) + 1:].decode("latin-1")
    except OSError:
        return None


def _save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` atomically, unless the PNG there already shows this very figure (same key): a
    live report redrawn on every point's start and end mostly redraws unchanged figures, and drawing one (constrained
    layout, then rendering) is most of a refresh's time."""
    path = Path(path)
    key = figure_key(fig)
    if key is not None and png_key(path) == key:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png.tmp")
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, format="png", dpi=DPI, metadata={KEY: key} if key is not None else None)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def _yerr(summaries: list[Summary]) -> list[list[float]]:
    """Error bars [below, above] the means: the 95% t interval, clipped to the metric's range (so not always
    symmetric); 0 where there is none (one run, or fewer than 3 seeds)."""
    return [[s.mean - s.lo if s.lo is not None else 0.0 for s in summaries],
            [s.hi - s.mean if s.hi is not None else 0.0 for s in summaries]]


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


def mean_curve(points: list[Point], metric: str) -> list[tuple[int, Summary]]:
    """Per step, the summary over the points that logged it (clipped to the metric's range, no interval below
    MIN_INTERVAL_N points: kdexp.report.ranges)."""
    by_step: dict[int, list[float]] = {}
    for p in points:
        for step, v in p.curves.get(metric) or []:
            by_step.setdefault(step, []).append(v)
    return [(step, clipped(metric, summarize(vs))) for step, vs in sorted(by_step.items())]


@dataclass
class Series:
    """One line of the curves plot: ``kind`` 'point' (no replicates), 'mean' (a configuration's finished seeds),
    'seed' (one finished seed, thin, unlabelled) or 'running' (a replicate not finished yet: its own dashed line, never
    averaged with finished ones). ``band``: (steps, lo, hi) of the mean's 95% interval where it has one."""

    label: Optional[str]
    steps: list[int]
    values: list[float]
    kind: str
    color: int
    style: str = "-"
    band: Optional[tuple[list[int], list[float], list[float]]] = None


def curve_series(sweep: Sweep, metric: str) -> list[Series]:
    """The lines of ``metric`` over step (see Series)."""
    out: list[Series] = []
    if not has_replicates(sweep):
        for i, p in enumerate(sweep.points):
            curve = p.curves.get(metric)
            if curve:
                steps, values = zip(*curve)
                out.append(Series(p.label if p.status == "finished" else f"{p.label} [{p.status}]", list(steps),
                                  list(values), "point", i % 10, _STYLE.get(p.status, "-")))
        return out
    for i, c in enumerate(configurations(sweep)):
        done = [p for p in c.finished if p.curves.get(metric)]
        for p in done:
            steps, values = zip(*p.curves[metric])
            out.append(Series(None, list(steps), list(values), "seed", i % 10))
        curve = mean_curve(done, metric)
        if curve:
            band = [(st, sm) for st, sm in curve if sm.lo is not None]
            out.append(Series(f"{c.label} (n={len(c.finished)})", [st for st, _ in curve], [sm.mean for _, sm in curve],
                              "mean", i % 10, band=([st for st, _ in band], [sm.lo for _, sm in band],
                                                    [sm.hi for _, sm in band]) if band else None))
        for p in c.points:
            if p.status != "finished" and p.status != "failed" and p.curves.get(metric):
                steps, values = zip(*p.curves[metric])
                out.append(Series(f"{c.label}, seed={short(p.seed)} [{p.status}]", list(steps), list(values),
                                  "running", i % 10, _STYLE.get(p.status, "--")))
    return out


def plot_curves(sweep: Sweep, path: str | Path, metrics: tuple[str, ...] = CURVE_METRICS) -> Optional[Path]:
    """train/loss and val/* over step, one line per point (dashed: running, dotted: failed); over replicates each
    finished seed as a thin line, their mean as a thick one with its 95% interval as a band (3 or more seeds), and
    every running replicate as its own dashed line. None without curves."""
    metrics = tuple(m for m in metrics if any(p.curves.get(m) for p in sweep.points))
    if not metrics:
        return None
    fig, axes = _figure(len(metrics))
    n_labels = 0
    for ax, metric in zip(axes, metrics):
        series = curve_series(sweep, metric)
        n_labels = max(n_labels, sum(s.label is not None for s in series))
        for s in series:
            color = f"C{s.color}"
            if s.kind == "seed":
                ax.plot(s.steps, s.values, "-", color=color, linewidth=0.8, alpha=0.35)
                continue
            ax.plot(s.steps, s.values, s.style, marker="o" if len(s.steps) < 12 else None, markersize=3,
                    color=color, label=s.label, linewidth=2.0 if s.kind == "mean" else 1.5)
            if s.band is not None:
                ax.fill_between(s.band[0], s.band[1], s.band[2], color=color, alpha=0.2, linewidth=0)
        ax.set_title(metric_label(metric))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    _legend(fig, axes, n_labels)
    if has_replicates(sweep):
        fig.suptitle("thin: each seed; thick: mean over finished seeds; band: 95% Student-t interval (3+ seeds); "
                     "dashed: running", fontsize="small")
    return _save(fig, path)


def _combos(sweep: Sweep, points: list[Point], key: str) -> dict[str, list[Point]]:
    """Points grouped by the values of the swept keys other than ``key`` (one line / bar series each)."""
    others = [k for k in sweep.config_keys if k != key]  # not the seed: its points are the replicates of a mean
    groups: dict[str, list[Point]] = {}
    for p in points:
        label = ", ".join(f"{k}={p.text(k)}" for k in others) or "all points"
        groups.setdefault(label, []).append(p)
    return groups


def _mean_by(points: list[Point], key: str, metric: str) -> dict[Any, Summary]:
    """The summary per value of ``key`` (NaN when a replicate is non-finite: a gap in the line, not a dropped run)."""
    groups: dict[Any, list[Point]] = {}
    for p in points:
        groups.setdefault(p.params.get(key), []).append(p)
    sums = {x: Configuration({}, members).summary(metric) for x, members in groups.items()}
    return {x: s for x, s in sums.items() if s.mean is not None}


def seed_values(points: list[Point], key: str, metric: str) -> list[tuple[Any, float]]:
    """(value of ``key``, final ``metric``) of every finished point: the dots behind each mean."""
    return [(p.params.get(key), v) for p, v in iter_values(points, metric)]


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
                ax.errorbar(xs, [means[x].mean for x in xs], yerr=_yerr([means[x] for x in xs]), fmt="o-",
                            capsize=3, color=f"C{gi % 10}", label=label)
                where = {x: x for x in xs}
            else:
                width = 0.8 / len(groups)
                where = {c: categories.index(c) - 0.4 + width * (gi + 0.5) for c in means}
                ax.bar(list(where.values()), [m.mean for m in means.values()], width=width, color=f"C{gi % 10}",
                       label=label, yerr=_yerr(list(means.values())), capsize=3)
            seeds = seed_values(members, key, metric)
            if has_replicates(sweep) and seeds:  # every seed, so the spread behind a mean is visible
                ax.plot([where[x] for x, _ in seeds], [v for _, v in seeds], "k.", markersize=4, alpha=0.6)
        if numeric:
            xs = [x for x in categories if x is not None]
            if min(xs) > 0 and max(xs) / min(xs) >= 100:  # lr-like sweeps span decades
                ax.set_xscale("log")
        else:
            names = [next(p.text(key) for p in points if p.params.get(key) == c) for c in categories]
            long = max(len(n) for n in names) > 10
            ax.set_xticks(range(len(categories)), names, rotation=20 if long else 0, ha="right" if long else "center",
                          rotation_mode="anchor")
        ax.set_title(metric_label(metric))
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    _legend(fig, axes, len(groups))
    fig.suptitle(f"final metrics against {key}" + ("; mean over seeds, error bars: 95% t interval (3+ seeds), "
                                                   "dots: each seed" if has_replicates(sweep) else ""))
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
            c = Configuration({}, [p for p in finished if p.arm == arm])
            s = c.summary(metric)
            if s.mean is not None:  # NaN (a non-finite replicate) draws no bar; the arms table says why
                ax.bar(i, s.mean, color=f"C{i % 10}", yerr=_yerr([s]), capsize=4, alpha=0.8)
                values = list(c.values(metric).values())
                if len(values) > 1:  # every seed, so the spread behind the interval is visible
                    ax.plot([i] * len(values), values, "k.", markersize=5)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(metric_label(metric))
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"arms ({sweep.arm_key})" + ("; bars: mean, error bars: 95% t interval, dots: seeds"
                                             if has_replicates(sweep) else ""))
    return _save(fig, path)


COST_AXES = ("cost/total_device_hours", "cost/tflop")


def plot_quality_vs_cost(sweep: Sweep, path: str | Path, quality: str = "val/kl_to_teacher",
                         axes_keys: tuple[str, ...] = COST_AXES) -> Optional[Path]:
    """``quality`` (final) against each cost axis (device-hours: machine-dependent; TFLOP: not): a dot per finished
    point (seed), and per configuration its mean with error bars (the 95% t interval, 3+ seeds). None when no
    finished point has both."""
    configs = [c for c in configurations(sweep)
               if any(quality in p.final and k in p.final for p in c.finished for k in axes_keys)]
    keys = [k for k in axes_keys if any(k in p.final for c in configs for p in c.finished)]
    if not configs or not keys:
        return None
    fig, axes = _figure(len(keys))
    for ax, key in zip(axes, keys):
        for i, c in enumerate(configs):
            pts = [(p.final[key], p.final[quality]) for p in c.finished if key in p.final and quality in p.final]
            if not pts:
                continue
            color = f"C{i % 10}"
            ax.plot([x for x, _ in pts], [y for _, y in pts], ".", color=color, alpha=0.5, markersize=5)
            sx, sy = c.summary(key), c.summary(quality)
            if sx.mean is not None and sy.mean is not None:
                ax.errorbar([sx.mean], [sy.mean], xerr=_yerr([sx]), yerr=_yerr([sy]), fmt="o", color=color,
                            markersize=7, capsize=3, label=f"{c.label} (n={len(pts)})")
        ax.set_xlabel(metric_label(key))
        ax.set_ylabel(metric_label(quality))
        ax.grid(alpha=0.3)
    _legend(fig, axes, len(configs))
    fig.suptitle(f"{quality} against cost; dots: each seed, markers: mean" +
                 (", error bars: 95% t interval (3+ seeds)" if has_replicates(sweep) else ""), fontsize="small")
    return _save(fig, path)


def write_plots(sweep: Sweep, out_dir: str | Path, quality: str = "val/kl_to_teacher") -> dict[str, Path]:
    """All plots of the sweep into ``out_dir``: {'curves': .., 'arms': .., 'vs <key>': .., 'quality vs cost': ..}
    for those that apply (``quality``: the metric drawn against cost). PNGs of an earlier report of the same dir
    that no longer apply are removed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Optional[Path]] = {"curves": plot_curves(sweep, out_dir / "curves.png"),
                                        "quality vs cost": plot_quality_vs_cost(sweep, out_dir / "cost.png", quality)}
    if sweep.arms:
        plots["arms"] = plot_arms(sweep, out_dir / "arms.png")
    for key in sweep.config_keys:  # the seed is not a parameter to plot against: it is what the error bars are over
        plots[f"vs {key}"] = plot_metric_vs_param(sweep, key, out_dir / f"vs_{safe_name(key)}.png")
    plots = {k: v for k, v in plots.items() if v is not None}
    # after the new files exist (a live page keeps showing the old ones until then): drop those that no longer apply
    for old in [*out_dir.glob("vs_*.png"), out_dir / "curves.png", out_dir / "arms.png", out_dir / "cost.png"]:
        if old not in plots.values():
            old.unlink(missing_ok=True)
    return plots
