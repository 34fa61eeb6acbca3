"""kdexp.report.stats against independent references: printed t tables, the closed-form t CDFs for 1 and 2 degrees of
freedom, hand computations, and scipy.stats (t.ppf, ttest_rel, ttest_ind) where it is installed (the dev extra
installs it, so under CI=true a missing scipy fails instead of skipping)."""
from __future__ import annotations

import math
import os

import pytest

from kdexp.report.stats import (compare, paired_difference, summarize, t_cdf, t_ppf, two_sided_p,
                                welch_difference)

# Two-sided 95% critical values t_{0.975, df} as printed in standard tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 9: 2.262, 10: 2.228, 20: 2.086, 30: 2.042,
        100: 1.984}
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 5: 2.015, 10: 1.812, 30: 1.697}  # one-sided 95%


def _scipy():
    try:
        import scipy.stats
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("scipy is not installed (it is in the dev extra): CI must check against it")
        pytest.skip("scipy is not installed here (pip install '.[dev]' installs it); the table tests still ran")
    return scipy.stats


@pytest.mark.parametrize("df,value", sorted(T975.items()))
def test_t_quantiles_match_the_printed_table(df, value):
    assert t_ppf(0.975, df) == pytest.approx(value, abs=6e-4)
    assert t_ppf(0.025, df) == pytest.approx(-value, abs=6e-4)
    if df in T95:
        assert t_ppf(0.95, df) == pytest.approx(T95[df], abs=6e-4)


def test_t_cdf_closed_forms():
    # df=1 is the Cauchy distribution: F(t) = 1/2 + atan(t)/pi; df=2: F(t) = 1/2 + t / (2 sqrt(2 + t^2))
    for t in (-30.0, -2.5, -0.3, 0.0, 0.7, 1.0, 4.303, 50.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    # the quantile inverts them exactly: df=2 has t_q = (2q-1) sqrt(2 / (4 q (1-q)))
    for q in (0.6, 0.9, 0.975, 0.995):
        assert t_ppf(q, 2) == pytest.approx((2 * q - 1) * math.sqrt(2 / (4 * q * (1 - q))), rel=1e-12)
        assert t_ppf(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-11)
    assert two_sided_p(3.0, 2) == pytest.approx(1 - 3 / math.sqrt(11), rel=1e-12)
    assert two_sided_p(60.0, 1) == pytest.approx(1 - 2 * math.atan(60.0) / math.pi, rel=1e-10)  # small tail, no cancellation
    with pytest.raises(ValueError, match="q=1.0"):
        t_ppf(1.0, 3)


def test_summary_by_hand():
    s = summarize([3.0, 3.2, 3.1])
    assert (s.n, s.nonfinite) == (3, 0)
    assert s.mean == pytest.approx(3.1, abs=1e-15)
    assert s.std == pytest.approx(0.1, abs=1e-15)  # sqrt((0.01 + 0.01 + 0) / 2)
    half = 4.302652729749464 * 0.1 / math.sqrt(3)  # t_{0.975, 2} (closed form above) * std / sqrt(n)
    assert (s.lo, s.hi) == (pytest.approx(3.1 - half, abs=1e-12), pytest.approx(3.1 + half, abs=1e-12))
    one = summarize([2.5])
    assert (one.n, one.mean, one.std, one.lo, one.hi) == (1, 2.5, None, None, None)
    assert summarize([]).mean is None
    bad = summarize([1.0, float("nan"), 2.0])
    assert math.isnan(bad.mean) and math.isnan(bad.lo) and bad.nonfinite == 1 and bad.n == 3


def test_paired_difference_by_hand():
    a = {1: 3.0, 2: 3.2, 3: 3.1, 4: 9.9}  # seed 4 has no partner: not used
    b = {3: 2.7, 1: 2.8, 2: 3.1}
    d = paired_difference(a, b)
    diffs = [0.2, 0.1, 0.4]  # by seed
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    se = sd / math.sqrt(3)
    t = mean / se
    assert (d.n, d.paired, d.df) == (3, True, 2)
    assert d.mean == pytest.approx(mean, abs=1e-14) and d.t == pytest.approx(t, rel=1e-12)
    assert d.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10)  # df=2 closed form: p = 0.118
    assert d.lo == pytest.approx(mean - 4.302652729749464 * se, abs=1e-12)
    assert d.significant is False and d.lo < 0 < d.hi
    # Pairing removes the between-seed spread: same numbers, seeds shifted by a common offset -> significant.
    a2 = {s: 5.0 * s + 0.3 + 0.01 * (s % 2) for s in (1, 2, 3, 4)}
    b2 = {s: 5.0 * s for s in (1, 2, 3, 4)}
    paired, unpaired = paired_difference(a2, b2), welch_difference(a2.values(), b2.values())
    assert paired.significant is True and paired.p < 1e-4
    assert unpaired.significant is False and unpaired.p > 0.9
    assert compare(a2, b2) == paired
    # Identical arms: difference 0, std 0: not significant (p = 1), not a division by zero.
    same = paired_difference({1: 2.0, 2: 3.0}, {1: 2.0, 2: 3.0})
    assert (same.mean, same.lo, same.hi, same.p, same.significant) == (0.0, 0.0, 0.0, 1.0, False)
    # One pair: a difference but no verdict; a NaN in a pair: NaN, no verdict, counted.
    assert paired_difference({1: 2.0}, {1: 1.5}).significant is None
    nan = paired_difference({1: 2.0, 2: float("nan")}, {1: 1.0, 2: 1.0})
    assert math.isnan(nan.mean) and nan.significant is None and nan.nonfinite == 1


def test_compare_without_common_seeds_is_welch():
    d = compare({1: 1.0, 2: 1.2, 3: 1.1}, {7: 2.0, 8: 2.1})
    assert not d.paired and d.n == 2 and d.significant is True
    assert compare({1: 1.0}, {2: 2.0}).significant is None


def test_against_scipy():
    st = _scipy()
    for df in (1, 2, 3, 4, 7, 29, 200, 2.5):
        for q in (0.5125, 0.9, 0.975, 0.995, 0.9995):
            assert t_ppf(q, df) == pytest.approx(st.t.ppf(q, df), rel=1e-10)
        for t in (0.1, 1.3, 4.0, 25.0):
            assert t_cdf(t, df) == pytest.approx(st.t.cdf(t, df), rel=1e-11, abs=1e-15)
    a = {1: 0.412, 2: 0.398, 3: 0.405, 4: 0.431, 5: 0.377}
    b = {1: 0.395, 2: 0.401, 3: 0.388, 4: 0.410, 5: 0.371}
    d = paired_difference(a, b)
    ref = st.ttest_rel(list(a.values()), [b[s] for s in a])
    assert d.t == pytest.approx(ref.statistic, rel=1e-10) and d.p == pytest.approx(ref.pvalue, rel=1e-9)
    lo, hi = ref.confidence_interval(0.95)
    assert (d.lo, d.hi) == (pytest.approx(lo, rel=1e-10), pytest.approx(hi, rel=1e-10))
    w = welch_difference([1.0, 1.4, 1.1, 1.3], [1.6, 1.5, 2.2])
    ref = st.ttest_ind([1.0, 1.4, 1.1, 1.3], [1.6, 1.5, 2.2], equal_var=False)
    assert w.t == pytest.approx(ref.statistic, rel=1e-10) and w.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert w.df == pytest.approx(ref.df, rel=1e-10)
    s = summarize([3.0, 3.2, 3.1, 2.7])
    lo, hi = st.t.interval(0.95, 3, loc=s.mean, scale=st.sem([3.0, 3.2, 3.1, 2.7]))
    assert (s.lo, s.hi) == (pytest.approx(lo, rel=1e-12), pytest.approx(hi, rel=1e-12))
