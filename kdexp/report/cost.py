"""What each configuration cost: per-point cost metrics from summary.json's ``cost`` record (kdexp.track.cost), the
cost table per configuration, and a chosen quality metric against cost.

Every point gets, under ``final`` (so configurations summarise them over seeds like any metric):
  cost/device_hours        its own training: wall_s x device_count / 3600            (machine-dependent)
  cost/cache_device_hours  its share of the teacher-cache build it used: the build's device-hours divided by the
                           points of this sweep that used that cache (0 for an online teacher)   (machine-dependent)
  cost/total_device_hours  the two together                                          (machine-dependent)
  cost/tokens              tokens trained (steps x global batch x sequence length)
  cost/tflop               model TFLOPs by kdexp.plan's formulas: the student's steps (forward + backward), the
                           teacher's forward in the steps (online) or its share of the cache build (cached)
  cost/tokens_per_s        tokens / wall_s                                           (machine-dependent)
A reused point carries the cost of the run it reused (what producing that result cost), not the ~0 s of reusing it.
"""
from __future__ import annotations

from typing import Any, Optional

from kdexp.report.model import Point, Sweep, is_finite
from kdexp.report.replicates import TIMING_KEYS as MACHINE_DEPENDENT, configurations
from kdexp.report.tables import Table, summary_notes, summary_text

COST_METRICS = ("cost/total_device_hours", "cost/device_hours", "cost/cache_device_hours", "cost/tokens",
                "cost/tflop", "cost/tokens_per_s")
DEFAULT_QUALITY = "val/kl_to_teacher"
HOW_TO_READ_COST = (
    "Cost per configuration, mean over its finished seeds. Device-hours = wall seconds x devices / 3600 of the "
    "training run, plus its share of the teacher-cache build it used (the build's device-hours divided by the points "
    "of this sweep that share that cache); they and tokens/s depend on the machine and its load (other points, "
    "other users) and are comparable only between points that ran on the same kind of machine at the same time. "
    "TFLOP are model FLOPs by kdexp.plan's formulas (student forward + backward, the teacher's forward in the "
    "steps or its share of the cache build; evaluation not counted): they do not depend on the machine.")


def _num(x: Any) -> Optional[float]:
    return float(x) if is_finite(x) else None


def _flops(point_cost: dict) -> Optional[float]:
    parts = [point_cost.get("student_flops"), point_cost.get("teacher_forward_flops")]
    return None if any(_num(p) is None for p in parts) else sum(float(p) for p in parts)


def add_cost_metrics(sweep: Sweep) -> None:
    """Fill each point's cost/* metrics from its cost record, the cache builds amortised over the sweep's points
    that share them (see the module docstring). Points without a cost record get none."""
    sharing: dict[str, int] = {}
    for p in sweep.points:
        cache = (p.cost or {}).get("cache") or {}
        if cache.get("path"):
            sharing[cache["path"]] = sharing.get(cache["path"], 0) + 1
    for p in sweep.points:
        c = p.cost or {}
        hours, tokens, wall = _num(c.get("device_hours")), _num(c.get("tokens")), _num(c.get("wall_s"))
        if hours is None:
            continue
        cache = c.get("cache") or {}
        build = cache.get("build") or {}
        share = sharing.get(cache.get("path"), 0)
        cache_hours = _num(build.get("device_hours"))
        cache_hours = cache_hours / share if cache_hours is not None and share else 0.0
        out = {"cost/device_hours": hours, "cost/cache_device_hours": cache_hours,
               "cost/total_device_hours": hours + cache_hours}
        if tokens is not None:
            out["cost/tokens"] = tokens
            if wall:
                out["cost/tokens_per_s"] = tokens / wall
        flops = _flops(c)
        if flops is not None:
            cache_flops = _num(cache.get("teacher_forward_flops"))
            out["cost/tflop"] = (flops + (cache_flops / share if cache_flops is not None and share else 0.0)) / 1e12
        p.final.update(out)


def has_cost(sweep: Sweep) -> bool:
    return any("cost/total_device_hours" in p.final for p in sweep.points)


def _device(points: list[Point]) -> str:
    kinds = list(dict.fromkeys(f"{(p.cost or {}).get('device_count', '?')} x {(p.cost or {}).get('device_kind', '?')}"
                               for p in points if p.cost))
    return "; ".join(kinds) or "—"


def cost_table(sweep: Sweep, quality: str = DEFAULT_QUALITY) -> Optional[Table]:
    """One row per configuration (a point, without seeds): devices, the cost metrics (mean over finished seeds) and
    the chosen quality metric beside them. None when no point has a cost record."""
    if not has_cost(sweep):
        return None
    configs = configurations(sweep)
    metrics = [*COST_METRICS, quality]
    columns = ["configuration", "n", "devices", *metrics]
    rows, text, sums_all, metrics_all = [], [], [], []
    for c in configs:
        sums = [c.summary(m) for m in metrics]
        sums_all += sums
        metrics_all += metrics
        rows.append([c.label, len(c.finished), _device(c.finished), *sums])
        text.append([c.label, f"{len(c.finished)}/{len(c.points)}", _device(c.finished),
                     *[summary_text(s) for s in sums]])
    return Table(columns, rows, text, title="Cost per configuration",
                 notes=[HOW_TO_READ_COST, *summary_notes(sums_all, metrics_all)])


__all__ = ["COST_METRICS", "MACHINE_DEPENDENT", "DEFAULT_QUALITY", "add_cost_metrics", "cost_table", "has_cost",
           "HOW_TO_READ_COST"]
