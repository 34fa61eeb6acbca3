"""Where each metric can lie, and what the report does with an interval that leaves that range or rests on too few
replicates. The one table of valid ranges (``METRIC_RANGES``) and the one small-n rule (``MIN_INTERVAL_N``).

A Student-t interval is symmetric around the mean, so over few seeds it can run past what a metric can take (a KL
below 0, an agreement above 1). The report clips such an interval to the metric's range and says it did
("clipped to [0, 1]"); a mean outside the range is never clipped (it would hide a bug): it is flagged.

Below ``MIN_INTERVAL_N`` replicates the interval is withheld: with n = 2 the 95% interval is mean ± t(0.975, 1) *
std / sqrt(2), and t(0.975, 1) = 12.71 (against 4.30 at n = 3 and 1.96 for n -> infinity), so two seeds give an
interval about 9 std wide that says nothing a reader can use. The mean, the std and every seed's value are still
shown; differences between configurations are still tested (a paired t test at n = 2 is exact, only weak) and marked.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from kdexp.report.stats import Summary, t_ppf

INF = math.inf
# metric -> (lowest, highest) value it can take. A metric not listed (or matched by a suffix rule below) is unbounded.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "val/kl_to_teacher": (0.0, INF),   # a KL divergence
    "val/onpolicy_reverse_kl": (0.0, INF),
    "val/top1_agreement": (0.0, 1.0),  # a fraction of tokens
    "train/kept_mass": (0.0, 1.0),     # a probability mass
    "train/ghost_mass": (0.0, 1.0),
    "val/lm_loss": (0.0, INF),         # cross-entropy
    "train/lm_loss": (0.0, INF),
    # train/kd_loss and train/loss are left unbounded: sampled KD's value is an importance-weighted estimate of the
    # KL (kdexp.losses.sampled), which can come out below 0 near convergence
    "train/nucleus_size": (1.0, INF),  # at least one token is kept
    "perf/tokens_per_s": (0.0, INF),
    "perf/step_ms": (0.0, INF),
}
# families of keys the table cannot list one by one (cost/*: seconds, FLOPs, device-hours are never negative)
PREFIX_RANGES: tuple[tuple[str, tuple[float, float]], ...] = (("cost/", (0.0, INF)),)

MIN_INTERVAL_N = 3  # replicates a configuration needs before its interval is shown (see the module docstring)
SMALL_N_MARK = "†"


def valid_range(metric: str) -> Optional[tuple[float, float]]:
    """(lo, hi) the metric can take, or None when it is unbounded (or unknown)."""
    if metric in METRIC_RANGES:
        return METRIC_RANGES[metric]
    for prefix, bounds in PREFIX_RANGES:
        if metric.startswith(prefix):
            return bounds
    return None


def t_factor(n: int) -> float:
    """t(0.975, n - 1): how many standard errors the 95% interval spans on each side with n replicates."""
    return t_ppf(0.975, n - 1)


def small_n_note() -> str:
    return (f"{SMALL_N_MARK} fewer than {MIN_INTERVAL_N} replicates: interval withheld (with n = 2 the 95% interval "
            f"is mean ± {t_factor(2):.1f} × std/√2, since t(0.975, 1) = {t_factor(2):.1f}; at n = 3 t = "
            f"{t_factor(3):.2f}). Run at least {MIN_INTERVAL_N} seeds for an interval.")


def clipped(metric: str, s: Summary) -> Summary:
    """``s`` with its interval clipped to the metric's valid range (``clipped`` names the range it was clipped to)
    and withheld below MIN_INTERVAL_N replicates (``small_n`` True). The mean is never changed: a mean outside the
    range is flagged by ``out_of_range``."""
    if s.mean is None or s.nonfinite:
        return s
    bounds = valid_range(metric)
    out = bounds is not None and not (bounds[0] <= s.mean <= bounds[1])
    if s.lo is None:
        return replace(s, out_of_range=out)
    if s.n < MIN_INTERVAL_N:
        return replace(s, lo=None, hi=None, small_n=True, out_of_range=out)
    if bounds is None:
        return s
    lo, hi = max(s.lo, bounds[0]), min(s.hi, bounds[1])
    if (lo, hi) == (s.lo, s.hi):
        return replace(s, out_of_range=out)
    return replace(s, lo=lo, hi=hi, clipped=bounds, out_of_range=out)


def range_text(bounds: tuple[float, float]) -> str:
    def one(x: float) -> str:
        return "∞" if x == INF else f"{x:g}"
    return f"[{one(bounds[0])}, {one(bounds[1])}" + (")" if bounds[1] == INF else "]")


__all__ = ["METRIC_RANGES", "PREFIX_RANGES", "MIN_INTERVAL_N", "SMALL_N_MARK", "valid_range", "clipped",
           "small_n_note", "range_text", "t_factor"]
