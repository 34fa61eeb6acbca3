"""Chosen comparisons, paired by seed, as one family: ``python -m kdexp.report SWEEP_DIR --pairs A:B [A:B ...]``.

A configuration is named by its swept values, ``key=value`` joined by commas (``arm=k8_ghost``,
``balancer.alpha=0.5,loss=topk``); a key may be shortened to its last part when that is unambiguous (``alpha=0.5``),
a value is matched as typed or as the value it resolves to (``alpha=1`` finds ``1.0``), and an arm may be named
alone (``k8_ghost``). Each pair A:B is tested on every metric asked for: A - B over the seeds both have (paired t
test; Welch's test when they share fewer than 2 seeds, and the method column says so).

The rows shown are one family: Holm's step-down correction over all of them (``stats.holm``), the corrected p beside
the uncorrected one; the verdict uses the corrected p (family-wise error rate 5%). The last column estimates the
seeds a paired t test needs to detect a difference of a given size (``--effect``; default: the difference observed)
with 80% power at Holm's strictest level 0.05 / m, from the observed standard deviation of the per-seed differences
(``stats.seeds_needed``: n = ((t(1 - a/2, n - 1) + t(power, n - 1)) * sd / delta)^2, iterated from the normal
approximation). The estimate is only as good as that sd: from 3 to 5 seeds it is itself uncertain.
"""
from __future__ import annotations

import math
from typing import Optional

from kdexp.report.model import Sweep, typed
from kdexp.report.replicates import Configuration, configurations, is_timing
from kdexp.report.stats import MAX_SEEDS, compare, holm, seeds_needed, summarize
from kdexp.report.tables import Table, fmt_p
from kdexp.track.records import parse_scalar

PAIR_METRICS = ("val/kl_to_teacher", "val/onpolicy_reverse_kl", "val/lm_loss", "val/top1_agreement")
ALPHA = 0.05
POWER = 0.8


def _key(sweep: Sweep, short: str) -> str:
    """A swept key from its full name or its unambiguous last part ('arm' is the arm)."""
    keys = sweep.config_keys
    if short in keys:
        return short
    if short == "arm" and sweep.arm_key is not None:
        return "arm"
    hits = [k for k in keys if k.split(".")[-1] == short or k.endswith("." + short)]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(keys + (["arm"] if sweep.arm_key else [])) or "none"
    raise ValueError(f"--pairs: key {short!r} is {'ambiguous' if hits else 'not swept'} in this sweep "
                     f"(swept keys: {known})")


def _matches(c: Configuration, key: str, value: str) -> bool:
    if key == "arm":
        return c.arm == value or ("arm" in c.params and c.text("arm") == value)
    have = c.params.get(key)
    return c.text(key) == value or typed(have) == value or (parse_scalar(value) == have and have is not None)


def find(sweep: Sweep, configs: list[Configuration], name: str) -> Configuration:
    """The one configuration ``name`` (key=value[,key=value], or an arm's name) picks; ValueError (one line) if none
    or several."""
    name = name.strip()
    if "=" not in name:
        found = [c for c in configs if c.arm == name or c.label == name]
    else:
        wanted = []
        for part in name.split(","):
            k, sep, v = part.strip().partition("=")
            if not sep:
                raise ValueError(f"--pairs: {part.strip()!r} in {name!r} is not key=value")
            wanted.append((_key(sweep, k.strip()), v.strip()))
        found = [c for c in configs if all(_matches(c, k, v) for k, v in wanted)]
    if len(found) != 1:
        names = "; ".join(c.label for c in configs)
        what = "no configuration" if not found else f"{len(found)} configurations"
        raise ValueError(f"--pairs: {name!r} names {what} (name one by its swept values; this sweep has: {names})")
    return found[0]


def parse_pairs(sweep: Sweep, specs: list[str]) -> list[tuple[Configuration, Configuration]]:
    configs = configurations(sweep)
    out = []
    for spec in specs:
        a, sep, b = spec.partition(":")
        if not sep or not a.strip() or not b.strip():
            raise ValueError(f"--pairs: {spec!r} is not A:B (two configurations named by their swept values)")
        ca, cb = find(sweep, configs, a), find(sweep, configs, b)
        if ca is cb:
            raise ValueError(f"--pairs: {spec!r} compares {ca.label} with itself")
        out.append((ca, cb))
    return out


def _name(c: Configuration) -> str:
    return c.arm if c.arm is not None and c.params.keys() <= {"arm"} else c.label


def pairs_table(sweep: Sweep, pairs: list[tuple[Configuration, Configuration]], metrics: tuple[str, ...],
                effect: Optional[float] = None, alpha: float = ALPHA, power: float = POWER) -> Table:
    """One row per pair x metric: A - B paired by seed, its 95% interval, the sd of the per-seed differences, the
    uncorrected p, Holm's p over the rows shown, the verdict at family-wise 5%, and the seeds needed."""
    for m in metrics:
        if is_timing(m):
            raise ValueError(f"--metric {m}: a timing metric measures the machine's load, it is never compared")
    found = []
    for a, b in pairs:
        for m in metrics:
            va, vb = a.values(m), b.values(m)
            d = compare(va, vb)
            common = [s for s in va if s in vb]
            spread = summarize([va[s] - vb[s] for s in common]).std if d.paired and len(common) >= 2 else None
            found.append((m, a, b, d, spread))
    adjusted = holm([d.p for _, _, _, d, _ in found])
    family = sum(p is not None for p in adjusted)
    level = alpha / max(family, 1)
    effect_head = f"seeds for |a - b| = {effect:g}" if effect is not None else "seeds for the observed a - b"
    columns = ["metric", "a", "b", "n", "a - b", "95% interval", "sd(a - b)", "p", f"p Holm (m={family})",
               "verdict", effect_head]
    rows, text = [], []
    for (m, a, b, d, spread), p_holm in zip(found, adjusted):
        delta = effect if effect is not None else d.mean
        n_for = (seeds_needed(spread, delta, alpha=level, power=power)
                 if spread is not None and delta is not None and math.isfinite(delta) else None)
        if p_holm is None:
            verdict = "not tested"
        else:
            verdict = "significant" if p_holm < alpha else "not significant"
        rows.append([m, _name(a), _name(b), d.n, d.mean, (d.lo, d.hi), spread, d.p, p_holm, verdict, n_for])
        text.append([m, _name(a), _name(b), str(d.n) + ("" if d.paired else " (Welch)"),
                     "—" if d.mean is None else f"{d.mean:+.4f}",
                     "—" if d.lo is None else f"[{d.lo:+.4f}, {d.hi:+.4f}]",
                     "—" if spread is None else f"{spread:.4f}", fmt_p(d.p), fmt_p(p_holm), verdict,
                     "—" if n_for is None else (f">{MAX_SEEDS}" if n_for > MAX_SEEDS else str(n_for))])
    notes = [
        f"a - b over the seeds both have (n), paired t test (Welch's where marked), 95% Student-t interval of the "
        f"mean difference (uncorrected). p Holm: Holm's step-down correction over the {family} comparisons shown; "
        f"significant = Holm p < {alpha:g} (family-wise error rate {alpha:.0%}).",
        f"Seeds needed: a paired t test with {power:.0%} power at Holm's strictest level {alpha:g}/{family} = "
        f"{level:.4g}, sd = the observed sd of the per-seed differences, n the smallest with "
        f"n >= ((t(1 - a/2, n - 1) + t(power, n - 1)) * sd / delta)^2 (iterated from the normal quantiles); "
        f"delta = {'%g' % effect if effect is not None else 'the observed a - b'}. "
        "From a few seeds that sd is itself rough: read it as an order of magnitude."]
    table = Table(columns, rows, text, title="Paired comparisons (Holm-corrected family)", notes=notes)
    table.bold = {(i, columns.index("verdict")) for i, r in enumerate(rows) if r[9] == "significant"}
    return table


__all__ = ["PAIR_METRICS", "pairs_table", "parse_pairs", "find", "ALPHA", "POWER"]
