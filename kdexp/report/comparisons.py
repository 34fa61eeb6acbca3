"""The replicate tables: configurations over seeds (mean ± std, n, 95% Student-t interval per metric) and the
differences between configurations, paired by seed, with their interval, p value and verdict at 95%."""
from __future__ import annotations

from typing import Optional

from kdexp.report.model import Sweep, short
from kdexp.report.ranges import MIN_INTERVAL_N, SMALL_N_MARK, t_factor
from kdexp.report.replicates import Configuration, configurations, has_replicates, is_timing, rank
from kdexp.report.stats import compare
from kdexp.report.tables import TABLE_METRICS, Table, fmt_p, goal, shown, summary_notes, summary_text, verdict


def configurations_table(sweep: Sweep, metrics: Optional[tuple[str, ...]] = None) -> Optional[Table]:
    """One row per configuration (the points differing only in trainer.seed): the swept values, n finished of the
    points, the seeds, each metric (default TABLE_METRICS, those logged: ``shown``) as mean ± std [95% t interval]
    over the finished replicates (raw values: the Summary), the statuses; the best mean bold. None without a swept
    seed."""
    metrics = shown(sweep, TABLE_METRICS) if metrics is None else metrics
    if not has_replicates(sweep):
        return None
    configs = configurations(sweep)
    columns = ["configuration", *sweep.config_keys, "n", "seeds", *metrics, "status"]
    rows, text = [], []
    all_sums, all_metrics = [], []
    for c in configs:
        sums = [c.summary(m) for m in metrics]
        all_sums += sums
        all_metrics += list(metrics)
        seeds = [p.seed for p in c.finished]
        rows.append([c.label, *[c.params.get(k) for k in sweep.config_keys], len(c.finished), seeds, *sums,
                     c.status_text()])
        text.append([c.label, *[c.text(k) for k in sweep.config_keys], f"{len(c.finished)}/{len(c.points)}",
                     " ".join(short(x) for x in seeds) or "—", *[summary_text(s) for s in sums], c.status_text()])
    table = Table(columns, rows, text, title="Configurations (mean ± std over seeds [95% Student-t interval])",
                  notes=summary_notes(all_sums, all_metrics))
    for m in metrics:
        r = rank(configs, m, goal(m))
        if r is not None:
            for c in (r.ties if r.tied else [r.best]):  # a tie bolds every tied value: no one of them is best
                table.bold.add((configs.index(c), columns.index(m)))
    return table


def differences_table(sweep: Sweep, metrics: Optional[tuple[str, ...]] = None) -> Optional[Table]:
    """Each configuration against a reference, per metric (default TABLE_METRICS, those logged: ``shown``): the first
    arm when the sweep has arms (before/after), else the best configuration. The difference of means, its 95% t
    interval, paired by seed (Welch when fewer than 2 seeds are shared), p and the verdict. Timing metrics are not
    compared. None without a swept seed."""
    metrics = shown(sweep, TABLE_METRICS) if metrics is None else metrics
    if not has_replicates(sweep):
        return None
    configs = configurations(sweep)
    if len(configs) < 2:
        return None
    columns = ["metric", "configuration", "vs", "difference", "95% interval", "method", "p", "verdict"]
    rows, text = [], []
    for m in metrics:
        if is_timing(m):
            continue
        if sweep.arms:
            ref: Optional[Configuration] = next((c for c in configs if c.arm == sweep.arms[0]), None)
        else:
            r = rank(configs, m, goal(m))
            ref = r.best if r is not None else None
        if ref is None or not ref.values(m):
            continue
        for c in configs:
            if c is ref or not c.values(m):
                continue
            d = compare(c.values(m), ref.values(m))
            interval = "—" if d.lo is None else f"[{d.lo:+.4f}, {d.hi:+.4f}]"
            small = d.lo is not None and d.n < MIN_INTERVAL_N
            rows.append([m, c.label, ref.label, d.mean, (d.lo, d.hi), d.method, d.p, d.significant])
            text.append([m, c.label, ref.label, "—" if d.mean is None else f"{d.mean:+.4f}", interval,
                         d.method + (SMALL_N_MARK if small else ""), fmt_p(d.p), verdict(d)])
    if not rows:
        return None
    title = ("Paired differences (configuration - vs; 95% Student-t interval of the mean difference; "
             "significant = the interval excludes 0, p < 0.05)")
    notes = []
    if any(SMALL_N_MARK in t[5] for t in text):
        notes.append(f"{SMALL_N_MARK} n = 2: the test is exact but weak (t(0.975, 1) = {t_factor(2):.1f}: only a "
                     f"difference about {t_factor(2):.0f} times its standard error is significant); "
                     f"run at least {MIN_INTERVAL_N} seeds.")
    table = Table(columns, rows, text, title=title, notes=notes)
    for i, row in enumerate(rows):
        if row[-1]:
            table.bold.add((i, columns.index("verdict")))
    return table


__all__ = ["configurations_table", "differences_table"]
