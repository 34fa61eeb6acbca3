"""Replicate statistics for the report: mean, std and a Student-t interval of a metric over seeds, and the difference
between two configurations, paired by seed (or Welch's unpaired test when they share too few seeds).

Stdlib only (``math``): a report runs on a laptop without scipy. The t distribution's CDF is the regularized
incomplete beta function (a continued fraction, Numerical Recipes' ``betacf``), its quantile the CDF inverted by
bisection; both agree with scipy.stats.t to ~1e-12 (tests/test_stats.py).

Non-finite values are not dropped: a summary or a difference with one has a NaN mean, no interval and no verdict,
and says how many values were non-finite.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Optional

CONFIDENCE = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast here; else use the symmetry I_x(a,b) = 1 - I_1-x(b,a)
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (df > 0, not necessarily an integer: Welch)."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (the t with t_cdf(t, df) = q), by bisection to float precision."""
    if not 0.0 < q < 1.0 or not df > 0:
        raise ValueError(f"t_ppf: q={q!r} must be in (0, 1) and df={df!r} > 0")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|)."""
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))  # directly, not 1 - cdf: no cancellation for large |t|


# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Summary:
    """A metric over ``n`` replicates: mean, sample std (ddof=1), and the Student-t interval [lo, hi] of the mean.
    std/lo/hi are None with fewer than 2 values; everything but n and nonfinite is NaN when a value is non-finite."""

    n: int
    mean: Optional[float]  # None: no value at all
    std: Optional[float] = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    nonfinite: int = 0
    confidence: float = CONFIDENCE
    # set by kdexp.report.ranges.clipped (the metric's valid range and the small-n rule live there):
    small_n: bool = False  # an interval was withheld: too few replicates
    clipped: Optional[tuple[float, float]] = None  # the valid range the interval was clipped to
    out_of_range: bool = False  # the mean itself lies outside the metric's valid range

    @property
    def half_width(self) -> Optional[float]:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2.0


def _interval(mean: float, std: float, n: int, confidence: float) -> tuple[float, float]:
    half = t_ppf(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
    return mean - half, mean + half


def summarize(values: Iterable[float], confidence: float = CONFIDENCE) -> Summary:
    """Mean, std and the ``confidence`` t interval of the values (NaN and infinities kept: they make the mean NaN)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Summary(0, None, confidence=confidence)
    bad = sum(not math.isfinite(x) for x in xs)
    if bad:
        nan = math.nan if n > 1 else None
        return Summary(n, math.nan, nan, nan, nan, bad, confidence)
    mean = math.fsum(xs) / n
    if n == 1:
        return Summary(1, mean, confidence=confidence)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    lo, hi = _interval(mean, std, n, confidence)
    return Summary(n, mean, std, lo, hi, 0, confidence)


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b): paired over the seeds both have (``paired``) or Welch's unpaired t (``paired`` False).
    ``significant`` is None when it cannot be told (fewer than 2 pairs / values, or a non-finite value)."""

    n: int  # pairs (paired) or the smaller of the two sample sizes (Welch)
    mean: Optional[float]
    lo: Optional[float] = None
    hi: Optional[float] = None
    t: Optional[float] = None
    df: Optional[float] = None
    p: Optional[float] = None
    significant: Optional[bool] = None
    paired: bool = True
    nonfinite: int = 0
    confidence: float = CONFIDENCE

    @property
    def method(self) -> str:
        return f"paired by seed (n={self.n})" if self.paired else f"unpaired, Welch (n>={self.n})"


def _test(mean: float, se: float, df: float, confidence: float) -> tuple[float, float, float, float]:
    """(lo, hi, t, p) of a mean difference with standard error ``se``; se = 0 means every pair differs equally."""
    if se == 0.0:
        return mean, mean, (0.0 if mean == 0 else math.copysign(math.inf, mean)), (1.0 if mean == 0 else 0.0)
    half = t_ppf(0.5 + confidence / 2.0, df) * se
    t = mean / se
    return mean - half, mean + half, t, two_sided_p(t, df)


def paired_difference(a: Mapping[Hashable, float], b: Mapping[Hashable, float],
                      confidence: float = CONFIDENCE) -> Difference:
    """a - b over the seeds (keys) both have: the mean of the per-seed differences, its t interval, the paired t
    test's p value (= scipy.stats.ttest_rel) and whether 0 is outside the interval."""
    seeds = [s for s in a if s in b]
    diffs = [float(a[s]) - float(b[s]) for s in seeds]
    n = len(diffs)
    bad = sum(not math.isfinite(d) for d in diffs)
    if n == 0:
        return Difference(0, None, confidence=confidence)
    if bad:
        return Difference(n, math.nan, nonfinite=bad, confidence=confidence)
    s = summarize(diffs, confidence)
    if n < 2:
        return Difference(n, s.mean, confidence=confidence)
    lo, hi, t, p = _test(s.mean, s.std / math.sqrt(n), n - 1, confidence)
    return Difference(n, s.mean, lo, hi, t, n - 1, p, p < 1.0 - confidence, True, 0, confidence)


def welch_difference(a: Iterable[float], b: Iterable[float], confidence: float = CONFIDENCE) -> Difference:
    """mean(a) - mean(b) without pairing: Welch's t test (= scipy.stats.ttest_ind(equal_var=False)), its
    Welch-Satterthwaite degrees of freedom and interval."""
    sa, sb = summarize(a, confidence), summarize(b, confidence)
    n = min(sa.n, sb.n)
    if sa.mean is None or sb.mean is None:
        return Difference(n, None, paired=False, confidence=confidence)
    if sa.nonfinite or sb.nonfinite:
        return Difference(n, math.nan, paired=False, nonfinite=sa.nonfinite + sb.nonfinite, confidence=confidence)
    mean = sa.mean - sb.mean
    if n < 2:
        return Difference(n, mean, paired=False, confidence=confidence)
    va, vb = sa.std ** 2 / sa.n, sb.std ** 2 / sb.n
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (sa.n - 1) + vb ** 2 / (sb.n - 1)) if se > 0 else float(sa.n + sb.n - 2)
    lo, hi, t, p = _test(mean, se, df, confidence)
    return Difference(n, mean, lo, hi, t, df, p, p < 1.0 - confidence, False, 0, confidence)


def compare(a: Mapping[Hashable, float], b: Mapping[Hashable, float], confidence: float = CONFIDENCE) -> Difference:
    """a - b, paired by seed when they share at least 2 seeds, else Welch when each has at least 2 values."""
    common = sum(s in b for s in a)
    if common >= 2 or (common and (len(a) < 2 or len(b) < 2)):
        return paired_difference(a, b, confidence)
    return welch_difference(a.values(), b.values(), confidence)


# ---------------------------------------------------------------------------------------------------------------------
def holm(pvalues: list[Optional[float]]) -> list[Optional[float]]:
    """Holm's step-down adjusted p values over the family of the p values given (None or NaN: not tested, not in the
    family). Sorted ascending, the i-th of m is multiplied by m - i + 1 (i from 1), made non-decreasing and capped
    at 1; an adjusted p below alpha rejects at family-wise error rate alpha (Holm 1979)."""
    tested = [i for i, p in enumerate(pvalues) if p is not None and not math.isnan(p)]
    m = len(tested)
    out: list[Optional[float]] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(tested, key=lambda j: pvalues[j])):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


def normal_ppf(q: float) -> float:
    """The q-quantile of the standard normal (the t quantile's limit; bisection on erfc)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"normal_ppf: q={q!r} must be in (0, 1)")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


MAX_SEEDS = 100_000  # beyond this the answer is "more than": the effect is negligible against the spread


def seeds_needed(sd: float, delta: float, alpha: float = 0.05, power: float = 0.8) -> Optional[int]:
    """Pairs (seeds) a two-sided paired t test needs to detect a mean difference ``delta`` with ``power`` at level
    ``alpha`` when the per-seed differences have standard deviation ``sd``: the smallest n >= 2 with
    n >= ((t(1 - alpha/2, n - 1) + t(power, n - 1)) * sd / delta)^2, iterated from the normal approximation
    n0 = ((z(1 - alpha/2) + z(power)) * sd / delta)^2 (the t quantiles replace z until n stops changing). None when
    sd or delta is not a positive finite number; MAX_SEEDS + 1 when even MAX_SEEDS would not do."""
    if not (math.isfinite(sd) and math.isfinite(delta)) or sd < 0 or delta == 0:
        return None
    if sd == 0:
        return 2  # every pair differs by the same amount: two pairs show it
    ratio = sd / abs(delta)
    n = max(2, math.ceil(((normal_ppf(1 - alpha / 2) + normal_ppf(power)) * ratio) ** 2))
    for _ in range(100):
        if n > MAX_SEEDS:
            return MAX_SEEDS + 1
        need = math.ceil(((t_ppf(1 - alpha / 2, n - 1) + t_ppf(power, n - 1)) * ratio) ** 2)
        if need <= n:  # n suffices; step down while a smaller n still does (the t quantiles shrink as n grows)
            while n > 2 and math.ceil(((t_ppf(1 - alpha / 2, n - 2) + t_ppf(power, n - 2)) * ratio) ** 2) <= n - 1:
                n -= 1
            return n
        n = need
    return n


__all__ = ["holm", "seeds_needed", "normal_ppf", "MAX_SEEDS", "CONFIDENCE", "Summary", "Difference", "summarize", "paired_difference", "welch_difference", "compare",
           "t_cdf", "t_ppf", "two_sided_p", "betainc"]
