"""Tables of a sweep (every point; configurations over seeds; the arms side by side; paired differences), the best
configuration per metric, and their Markdown/HTML.

A ``Table`` keeps the raw values (what tests and notebooks compute with) next to the text shown, so the Markdown
file, the HTML page and the notebook print the same numbers. "—" is a missing value; a non-finite one is shown as
"NaN", "Infinity" or "-Infinity" (as records stores it), and a mean over replicates with a non-finite value is NaN
with the count ("NaN (1 of 2 non-finite)"), never the mean of the rest. Over replicates a cell reads
"mean ± std [95% t interval]"; timing metrics (perf/*) are labelled machine-dependent and never ranked.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from kdexp.report.model import MISSING, Point, Sweep, aggregate
from kdexp.report.params import config_differences
from kdexp.report.ranges import SMALL_N_MARK, range_text, small_n_note, valid_range
from kdexp.report.replicates import Configuration, Ranking, configurations, has_replicates, is_timing, metric_label, rank
from kdexp.report.stats import Difference, Summary, holm
from kdexp.track.records import parse_scalar

# The per-point table's metric columns, in order.
TABLE_METRICS = ("val/lm_loss", "val/kl_to_teacher", "val/onpolicy_reverse_kl", "val/top1_agreement",
                 "train/kept_mass", "perf/tokens_per_s")
# Which way is better. train/kept_mass is left out on purpose: it describes the loss setting (a larger Top-K keeps
# more teacher mass), it is not something to maximise. Timing metrics have no goal here: points of a sweep run under
# different machine load (other points, other users), so a faster point is no finding (replicates.is_timing).
GOALS = {"val/lm_loss": "min", "val/kl_to_teacher": "min", "val/top1_agreement": "max", "val/onpolicy_reverse_kl": "min",
         "train/loss": "min", "train/lm_loss": "min", "train/kd_loss": "min"}
BEST_METRICS = ("val/lm_loss", "val/kl_to_teacher", "val/onpolicy_reverse_kl", "val/top1_agreement")
# Metrics shown only where some point logged them: runs made before it existed, and runs that cannot generate
# (sequence parallelism), have no val/onpolicy_reverse_kl; a column of dashes would say nothing.
IF_LOGGED = ("val/onpolicy_reverse_kl",)


def shown(sweep: Sweep, metrics: tuple[str, ...]) -> tuple[str, ...]:
    """``metrics`` less those of IF_LOGGED that no point of ``sweep`` logged (in its final metrics)."""
    return tuple(m for m in metrics if m not in IF_LOGGED or any(m in p.final for p in sweep.points))


def goal(metric: str) -> Optional[str]:
    """'min', 'max' or None (no better direction; always None for timing metrics)."""
    if is_timing(metric):
        return None
    if metric in GOALS:
        return GOALS[metric]
    name = metric.lower()
    if "loss" in name or "kl" in name:
        return "min"
    if "agreement" in name or "accuracy" in name:
        return "max"
    return None


def fmt(value: Any) -> str:
    """Numbers the same everywhere: ints as is, |x| >= 100 with one decimal, else four; NaN as NaN ("—" = missing)."""
    if value is None or value is MISSING:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4f}"


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]]  # raw values
    text: list[list[str]]  # what is shown, same shape as rows
    bold: set[tuple[int, int]] = field(default_factory=set)  # (row, column) of the best values
    title: str = ""
    notes: list[str] = field(default_factory=list)  # printed under the table (small-n, clipped intervals, ties)

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r)) for r in self.rows]


@dataclass
class Best:
    """The best configuration for a metric (a single point when there are no replicates): ``point`` is its first
    finished point, ``value`` its mean, ``ranking`` the comparison with the runner-up."""

    metric: str
    goal: str
    point: Point
    value: float
    ranking: Optional[Ranking] = None

    @property
    def tied(self) -> bool:
        return self.ranking is not None and self.ranking.tied

    @property
    def points(self) -> list[Point]:
        """The best point, or every tied configuration's first finished point on a tie."""
        if not self.tied:
            return [self.point]
        return [c.finished[0] for c in self.ranking.ties]


def fmt_p(p: Optional[float]) -> str:
    if p is None or math.isnan(p):
        return "—"
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def summary_text(s: Summary, with_n: bool = False) -> str:
    """'mean ± std [lo, hi]' (the 95% t interval of the mean); one value as is; NaN with the non-finite count.
    Below 3 replicates 'mean ± std (n=2†: no interval)'; an interval clipped to the metric's valid range says so,
    and a mean outside that range is flagged (kdexp.report.ranges)."""
    if s.mean is None:
        return "—"
    if s.nonfinite:
        return f"NaN ({s.nonfinite} of {s.n} non-finite)"
    n = f" (n={s.n})" if with_n else ""
    if s.small_n:
        text = f"{fmt(s.mean)} ± {fmt(s.std)} (n={s.n}{SMALL_N_MARK}: no interval)"
    elif s.std is None:
        text = fmt(s.mean) + n
    else:
        text = f"{fmt(s.mean)} ± {fmt(s.std)} [{fmt(s.lo)}, {fmt(s.hi)}]" + n
        if s.clipped is not None:
            text += f" (clipped to {range_text(s.clipped)})"
    return text + (" (OUTSIDE the valid range!)" if s.out_of_range else "")


def summary_notes(summaries: list[Summary], metrics: list[str]) -> list[str]:
    """The notes a table of these summaries needs: why an interval is missing, which ranges clipped one."""
    notes = []
    if any(s.small_n for s in summaries):
        notes.append(small_n_note())
    clipped = list(dict.fromkeys(m for s, m in zip(summaries, metrics) if s.clipped is not None))
    if clipped:
        notes.append("A Student-t interval is symmetric, so over few seeds it can leave what a metric can take; "
                     "such intervals are clipped to the metric's valid range (" + ", ".join(
                         f"{m} in {range_text(valid_range(m))}" for m in clipped) + ").")
    if any(s.out_of_range for s in summaries):
        notes.append("OUTSIDE the valid range: a mean no correct run can produce; check that point's logs.")
    return notes


def difference_text(d: Difference) -> str:
    """'-0.1200 [-0.2000, -0.0400], paired by seed (n=3), p=0.0123'."""
    if d.mean is None:
        return "no common values"
    if d.nonfinite:
        return f"NaN ({d.nonfinite} non-finite)"
    if d.lo is None:
        return f"{d.mean:+.4f} ({d.method}: too few to test)"
    return f"{d.mean:+.4f} [{d.lo:+.4f}, {d.hi:+.4f}], {d.method}, p={fmt_p(d.p)}"


def verdict(d: Optional[Difference]) -> str:
    if d is None or d.significant is None:
        return "not tested (needs 2 replicates)" if d is None or not d.nonfinite else "not tested (non-finite)"
    return "significant at 95%" if d.significant else "not significant at 95%"


# ---------------------------------------------------------------------------------------------------------------------
def best_points(sweep: Sweep, metrics: Optional[tuple[str, ...]] = None) -> dict[str, Best]:
    """The best finished configuration per metric (default BEST_METRICS, those logged: ``shown``; min for losses/KL,
    max for agreement; the mean over its seeds; first on ties), with its comparison against the runner-up. Timing
    metrics are never ranked."""
    metrics = shown(sweep, BEST_METRICS) if metrics is None else metrics
    out = {}
    configs = configurations(sweep)
    for metric in metrics:
        r = rank(configs, metric, goal(metric))
        if r is not None:
            out[metric] = Best(metric, r.goal, r.best.finished[0], r.summary.mean, r)
    return out


def best_lines(best: dict[str, Best]) -> list[str]:
    """One line per metric: the best configuration, then whether it is significantly better than the runner-up.
    The lines' tests are one family: judged on Holm's corrected p over the lines that test (stats.holm), which each
    line names next to the uncorrected p."""
    word = {"min": "lowest", "max": "highest"}
    tested = {m: b.ranking.difference.p for m, b in best.items() if b.ranking is not None and not b.tied
              and b.ranking.runner_up is not None and b.ranking.significant is not None}
    corrected = dict(zip(tested, holm(list(tested.values()))))
    lines = []
    for b in best.values():
        r = b.ranking
        if b.tied:
            names = "; ".join(c.label for c in r.ties)
            line = (f"{b.metric} ({word[b.goal]} is best): tie - {len(r.ties)} configurations share "
                    f"{fmt(b.value)} exactly ({names}): no best")
            if r.runner_up is not None:
                line += f"; next: {r.runner_up.label} ({summary_text(r.runner_up_summary)})"
            lines.append(line)
            continue
        if r is None or (r.summary.n <= 1 and (r.runner_up_summary is None or r.runner_up_summary.n <= 1)):
            where = f"{b.point.name}" + (f" ({b.point.label})" if b.point.label != b.point.name else "")
            line = f"{b.metric} ({word[b.goal]} is best): {fmt(b.value)} at {where}"
            if r is not None and r.runner_up is not None:
                line += " - one run each: not tested against the runner-up (sweep trainer.seed for intervals)"
            lines.append(line)
            continue
        line = f"{b.metric} ({word[b.goal]} is best): {summary_text(r.summary, with_n=True)} at {r.best.label}"
        if r.runner_up is not None:
            d = r.difference
            p_holm = corrected.get(b.metric)
            if p_holm is None:
                judged = "not tested against"
            elif p_holm < 1.0 - d.confidence:
                judged = "significantly better than"
            else:
                judged = "NOT significantly better than"
            line += (f" - {judged} the runner-up {r.runner_up.label} ({summary_text(r.runner_up_summary)}):"
                     f" difference {difference_text(d)}")
            if p_holm is not None:
                line += f", Holm over the {len(corrected)} best lines p={fmt_p(p_holm)}"
        lines.append(line)
    return lines


def swept_text(point: Point, key: str) -> str:
    """The swept value as typed, with the resolved value when it reads differently ('1e-3' stays; '${x}' shows
    what it resolved to; a point that did not set the key shows its default)."""
    raw = point.overrides.get(key, MISSING)
    resolved = point.params.get(key)
    if raw is MISSING:
        return f"{point.text(key)} (default)" if resolved is not None else "—"
    if raw is None:
        return "(deleted)"
    return raw if parse_scalar(raw) == resolved else f"{raw} (= {point.text(key)})"


def _status_text(p: Point, metrics: tuple[str, ...]) -> str:
    if p.status == "finished" and p.reused_from:
        text = "finished (reused)"
    elif p.status != "finished" and p.final_partial and any(p.final.get(m) is not None for m in metrics):
        text = f"{p.status} (last {'finite' if p.status == 'diverged' else 'logged'} values)"
    else:
        text = p.status
    return text + (f"; counted once with {', '.join(p.copies)}" if p.copies else "")


def points_table(sweep: Sweep, metrics: Optional[tuple[str, ...]] = None) -> Table:
    """One row per point: name, swept values, final metrics (default TABLE_METRICS, those logged: ``shown``), steps,
    status, error (one line)."""
    metrics = shown(sweep, TABLE_METRICS) if metrics is None else metrics
    columns = ["point", *sweep.swept, *metrics, "steps", "status", "error"]
    rows, text = [], []
    for p in sweep.points:
        values = [p.final.get(m) for m in metrics]
        rows.append([p.name, *[p.params.get(k) for k in sweep.swept], *values, p.steps, p.status, p.error])
        err = (p.error or "")
        text.append([p.name, *[swept_text(p, k) for k in sweep.swept], *[fmt(v) for v in values], fmt(p.steps),
                     _status_text(p, metrics), err if len(err) <= 160 else err[:157] + "..."])
    table = Table(columns, rows, text, title="Points")
    if not has_replicates(sweep):  # over replicates the configurations table marks the best, not one lucky seed
        for metric, b in best_points(sweep, metrics).items():
            for p in b.points:  # every tied point: bold marks the best value, never one of equals
                table.bold.add((sweep.points.index(p), columns.index(metric)))
    return table


def summarize_arm(points: list[Point], metric: str) -> Summary:
    """The metric over an arm's finished points (their seeds as keys, as configurations do)."""
    return Configuration({}, list(points)).summary(metric)


def arms_table(sweep: Sweep, metrics: Optional[tuple[str, ...]] = None) -> Optional[Table]:
    """The arms side by side: one column per arm; rows = points, the config keys the arms set differently, then each
    metric (default TABLE_METRICS, those logged: ``shown``) averaged over the arm's finished points with its change
    against the first arm (NaN with the count when a replicate is non-finite). None without arms."""
    metrics = shown(sweep, TABLE_METRICS) if metrics is None else metrics
    arms = sweep.arms
    if not arms:
        return None
    members = {a: [p for p in sweep.points if p.arm == a] for a in arms}
    columns = [sweep.arm_key or "arm", *arms]
    rows: list[list[Any]] = [["points", *[len(members[a]) for a in arms]],
                             *([status, *[sum(p.status == status for p in members[a]) for a in arms]]
                               for status in ("finished", "diverged", "failed")
                               if status == "finished" or any(p.status == status for p in sweep.points))]
    text = [[r[0], *[str(v) for v in r[1:]]] for r in rows]
    # What the arm changes: config keys that differ between arms, read from each arm's first point with a config.
    reps = [next((p for p in members[a] if p.config), None) for a in arms]
    if all(r is not None for r in reps) and len(reps) > 1:
        for key, values in config_differences(reps, exclude=(sweep.arm_key or "",)).items():
            rows.append([key, *values])
            text.append([key, *[fmt(v) for v in values]])
    bold = set()
    summaries: list[Summary] = []
    summary_metrics: list[str] = []
    for metric in metrics:
        aggs = [aggregate([p for p in members[a] if p.status == "finished"], metric) for a in arms]
        means = [g.mean for g in aggs]
        if all(m is None for m in means):
            continue
        ref = means[0]
        sums = [summarize_arm(members[a], metric) for a in arms]
        cells = []
        for i, (m, g) in enumerate(zip(means, sums)):
            cell = summary_text(g)
            if i > 0 and m is not None and ref not in (None, 0) and math.isfinite(m) and math.isfinite(ref):
                cell += f" ({100.0 * (m - ref) / abs(ref):+.1f}%)"
            cells.append(cell)
        direction = goal(metric)
        present = [(i, m) for i, m in enumerate(means) if m is not None and math.isfinite(m)]
        if direction and len(present) > 1:
            top = (min if direction == "min" else max)(m for _, m in present)
            bold.update((len(rows), 1 + i) for i, m in present if m == top)  # ties: all of them
        summaries += sums
        summary_metrics += [metric] * len(sums)
        rows.append([metric, *means])
        text.append([metric_label(metric), *cells])
    n = max(len(m) for m in members.values())
    title = "Arms" + (" (metrics: mean ± std over each arm's finished points [95% Student-t interval])"
                      if n > 1 else "")
    return Table(columns, rows, text, bold, title=title, notes=summary_notes(summaries, summary_metrics))


# ---------------------------------------------------------------------------------------------------------------------
def to_markdown(table: Table) -> str:
    def cell(t: str, bold: bool) -> str:
        t = t.replace("|", "\\|").replace("\n", " ")
        return f"**{t}**" if bold and t not in ("", "—") else t

    lines = ["| " + " | ".join(metric_label(c).replace("|", "\\|") for c in table.columns) + " |",
             "| " + " | ".join("---" for _ in table.columns) + " |"]
    for i, row in enumerate(table.text):
        lines.append("| " + " | ".join(cell(t, (i, j) in table.bold) for j, t in enumerate(row)) + " |")
    if table.notes:
        lines += [""] + [f"{note}  " for note in table.notes]
    return "\n".join(lines)


def to_html(table: Table, css_class: str = "kdexp") -> str:
    head = "".join(f"<th>{html.escape(metric_label(c))}</th>" for c in table.columns)
    body = []
    for i, row in enumerate(table.text):
        cells = []
        for j, t in enumerate(row):
            t = html.escape(t)
            cells.append(f"<td><b>{t}</b></td>" if (i, j) in table.bold else f"<td>{t}</td>")
        status = table.rows[i][table.columns.index("status")] if "status" in table.columns else ""
        body.append(f'<tr class="{html.escape(str(status))}">' + "".join(cells) + "</tr>")
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in table.notes)
    return (f'<table class="{css_class}"><thead><tr>{head}</tr></thead><tbody>' + "".join(body) + "</tbody></table>"
            + notes)


def summary_line(sweep: Sweep) -> str:
    c = sweep.counts()
    parts = [f"{c[s]} {s}" for s in ("finished", "failed", "diverged", "interrupted", "running", "pending") if c[s]]
    line = f"{len(sweep.points)} point{'s' if len(sweep.points) != 1 else ''}: " + ", ".join(parts)
    if sweep.duplicates:
        line += (f" ({len(sweep.points) + len(sweep.duplicates)} run dirs: {len(sweep.duplicates)} hold a training "
                 "another run dir holds, counted once)")
    return line


__all__ = ["TABLE_METRICS", "GOALS", "BEST_METRICS", "IF_LOGGED", "shown", "Table", "Best", "goal", "fmt",
           "best_points", "best_lines", "points_table", "arms_table", "to_markdown", "to_html",
           "summary_line", "swept_text", "summary_text", "summary_notes", "difference_text", "verdict"]
