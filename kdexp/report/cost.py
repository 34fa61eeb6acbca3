"""What each configuration cost: per-point cost metrics from summary.json's ``cost`` record (kdexp.track.cost), the
cost table per configuration, and a chosen quality metric against cost.

One-time work is what a point did once for the points after it: the embedded teacher's pretraining (``one_time``)
and a teacher-cache build (``cache``). Whichever point needed it first paid for it in its wall time; the report takes
it out of that point's training and shares each build over the points of the report that used it, so the first
point of a sweep does not look four times as dear as the others.

Every point gets, under ``final`` (so configurations summarise them over seeds like any metric):
  cost/device_hours           its own training: wall_s x device_count / 3600, less the builds it did (machine-dep.)
  cost/one_time_device_hours  its share of the one-time work it used: each build's device-hours divided by the
                              points of this report that used that artefact                    (machine-dependent)
  cost/total_device_hours     the two together                                                 (machine-dependent)
  cost/tokens                 tokens trained (steps x global batch x sequence length)
  cost/tflop                  model TFLOPs by kdexp.plan's formulas: the student's steps (forward + backward), the
                              teacher's forward in the steps (online), and its share of the one-time work's FLOPs
                              (a cache build's teacher pass; the teacher's pretraining, forward + backward)
  cost/tokens_per_s           tokens / training wall seconds                                  (machine-dependent)
A reused point carries the cost of the run it reused (what producing that result cost), not the ~0 s of reusing it;
it is counted once with that run (kdexp.report.trainings), so the shares are over the trainings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from kdexp.report.model import Point, Sweep, is_finite
from kdexp.report.replicates import TIMING_KEYS as MACHINE_DEPENDENT, configurations
from kdexp.report.tables import Table, fmt, summary_notes, summary_text

COST_METRICS = ("cost/total_device_hours", "cost/device_hours", "cost/one_time_device_hours", "cost/tokens",
                "cost/tflop", "cost/tokens_per_s")
# the table's columns: the two parts of the device-hours (their sum is the plot's axis) and the FLOPs
TABLE_COST_METRICS = ("cost/device_hours", "cost/one_time_device_hours", "cost/tflop")
DEFAULT_QUALITY = "val/kl_to_teacher"
HOW_TO_READ_COST = (
    "Cost per configuration, mean over its finished seeds. cost/device_hours: the training run, wall seconds x "
    "devices / 3600, less the one-time work it happened to do; cost/one_time_device_hours: its share of the one-time "
    "work it used (each build's device-hours divided by the points of this report that used it; the list below). "
    "The first point a process runs still pays that process's cold start (imports; the corpus, tokenizer and "
    "datasets on a cold cache): it is not split out. "
    "Device-hours and tokens/s are machine-dependent: they measure the machine and its load while a point ran "
    "(other points, other users) and compare only points that ran on the same kind of machine at the same time. "
    "TFLOP are model FLOPs by kdexp.plan's formulas (student forward + backward, the teacher's forward in the steps, "
    "the share of the one-time work; evaluation not counted): they do not depend on the machine.")


def _num(x: Any) -> Optional[float]:
    return float(x) if is_finite(x) else None


@dataclass
class OneTime:
    """One piece of one-time work seen in the report: what, where, what building it cost, who used it."""

    what: str
    path: str
    device_hours: Optional[float] = None  # None: not recorded (built before build records existed)
    flops: Optional[float] = None
    built_by: Optional[str] = None  # the point that built it, when it is in the report
    users: list[str] = field(default_factory=list)


def _one_time_entries(cost: dict) -> Iterator[tuple[str, str, dict, Optional[float], bool]]:
    """(what, path, build record, FLOPs, built here) of every one-time work a point's cost record names."""
    cache = cost.get("cache") or {}
    if cache.get("path"):
        yield ("teacher-cache build", cache["path"], cache.get("build") or {}, _num(cache.get("teacher_forward_flops")),
               bool(cache.get("built_here")))
    for entry in cost.get("one_time") or []:
        if isinstance(entry, dict) and entry.get("path"):
            yield (str(entry.get("what") or "one-time work"), entry["path"], entry.get("build") or {},
                   _num(entry.get("flops")), bool(entry.get("built_here")))


def one_time_work(sweep: Sweep) -> dict[str, OneTime]:
    """The one-time work the report's points used, by artefact path, with the points that used it."""
    out: dict[str, OneTime] = {}
    for p in sweep.points:
        for what, path, build, flops, built in _one_time_entries(p.cost or {}):
            w = out.setdefault(path, OneTime(what, path, _num(build.get("device_hours")), flops))
            w.users.append(p.name)
            if built:
                w.built_by = p.name
    return out


def add_cost_metrics(sweep: Sweep) -> None:
    """Fill each point's cost/* metrics from its cost record, the one-time work taken out of the point that did it
    and shared over the report's points that used it (see the module docstring). Points without a cost record get
    none."""
    work = one_time_work(sweep)
    sweep.one_time = list(work.values())
    for p in sweep.points:
        c = p.cost or {}
        hours, tokens, wall = _num(c.get("device_hours")), _num(c.get("tokens")), _num(c.get("wall_s"))
        if hours is None:
            continue
        share_hours, share_flops, built_hours = 0.0, 0.0, 0.0
        count = max(1, _num(c.get("device_count")) or 1)
        for _what, path, build, flops, built in _one_time_entries(c):
            w = work[path]
            if w.device_hours is not None:
                share_hours += w.device_hours / len(w.users)
            if built:  # this point's wall time holds the build it did (its own record of it)
                built_hours += _num(build.get("device_hours")) or 0.0
            if flops is not None:
                share_flops += flops / len(w.users)
        training = max(0.0, hours - built_hours)
        out = {"cost/device_hours": training, "cost/one_time_device_hours": share_hours,
               "cost/total_device_hours": training + share_hours}
        if tokens is not None:
            out["cost/tokens"] = tokens
            train_wall = training * 3600.0 / count if wall else None
            if train_wall:
                out["cost/tokens_per_s"] = tokens / train_wall
        parts = [_num(c.get("student_flops")), _num(c.get("teacher_forward_flops"))]
        if None not in parts:
            out["cost/tflop"] = (sum(parts) + share_flops) / 1e12
        p.final.update(out)


def has_cost(sweep: Sweep) -> bool:
    return any("cost/total_device_hours" in p.final for p in sweep.points)


def _device(points: list[Point]) -> str:
    kinds = list(dict.fromkeys(f"{(p.cost or {}).get('device_count', '?')} x {(p.cost or {}).get('device_kind', '?')}"
                               for p in points if p.cost))
    return "; ".join(kinds) or "—"


def one_time_note(sweep: Sweep) -> Optional[str]:
    """The one-time work the shares come from, one clause per kind of work."""
    work = sweep.one_time
    if not work:
        return None
    by_what: dict[str, list[OneTime]] = {}
    for w in work:
        by_what.setdefault(w.what, []).append(w)
    parts = []
    for what, items in by_what.items():
        known = [w.device_hours for w in items if w.device_hours is not None]
        users = sum(len(w.users) for w in items)
        text = (f"{what}: {len(items)} build{'s' if len(items) != 1 else ''} used by {users} point"
                f"{'s' if users != 1 else ''}")
        if known:
            text += f", {fmt(sum(known))} device-hours in all"
        missing = len(items) - len(known)
        if missing:
            text += (f" ({missing} built before build records existed: its cost stays in the training of the "
                     "point that built it)")
        parts.append(text)
    return "One-time work, shared over the points that used it: " + "; ".join(parts) + "."


def cost_table(sweep: Sweep, quality: str = DEFAULT_QUALITY) -> Optional[Table]:
    """One row per configuration: n, the training device-hours, the one-time share, TFLOP (means over the finished
    seeds) and the chosen quality metric beside them; the devices and the tokens per point, when every point has
    the same, go into a note instead of a column. None when no point has a cost record."""
    if not has_cost(sweep):
        return None
    configs = configurations(sweep)
    devices = {_device([p]) for c in configs for p in c.finished if p.cost}
    tokens = {p.final.get("cost/tokens") for c in configs for p in c.finished}
    extra = ([] if len(devices) <= 1 else ["devices"]) + ([] if len(tokens) <= 1 else ["cost/tokens"])
    metrics = [*TABLE_COST_METRICS, quality]
    columns = ["configuration", "n", *extra, *metrics]
    rows, text, sums_all, metrics_all = [], [], [], []
    for c in configs:
        sums = [c.summary(m) for m in metrics]
        sums_all += sums
        metrics_all += metrics
        more = [_device(c.finished)] if "devices" in extra else []
        more_text = list(more)
        if "cost/tokens" in extra:
            s = c.summary("cost/tokens")
            more.append(s)
            more_text.append(summary_text(s))
        rows.append([c.label, len(c.finished), *more, *sums])
        text.append([c.label, f"{len(c.finished)}/{len(c.points)}", *more_text, *[summary_text(s) for s in sums]])
    notes = [HOW_TO_READ_COST]
    same = []
    if len(devices) == 1:
        same.append(f"devices {next(iter(devices))}")
    if len(tokens) == 1 and next(iter(tokens)) is not None:
        same.append(f"{int(next(iter(tokens))):,} tokens trained")
    if same:
        notes.append("Every point: " + ", ".join(same) + ".")
    note = one_time_note(sweep)
    if note:
        notes.append(note)
    return Table(columns, rows, text, title="Cost per configuration",
                 notes=[*notes, *summary_notes(sums_all, metrics_all)])


__all__ = ["COST_METRICS", "TABLE_COST_METRICS", "MACHINE_DEPENDENT", "DEFAULT_QUALITY", "add_cost_metrics",
           "cost_table", "has_cost", "HOW_TO_READ_COST", "OneTime", "one_time_work", "one_time_note"]
