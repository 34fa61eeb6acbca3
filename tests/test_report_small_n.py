"""Reports that stay honest at any number of seeds: intervals withheld below 3 replicates (with the reason), clipped
to each metric's valid range, exact ties reported as ties, running replicates kept apart from finished ones, swept
values printed as typed, and every seed drawn. Numbers checked against hand computations (closed-form t quantiles).
"""
from __future__ import annotations

import math

import pytest

from kdexp.report import best_lines, best_points, configurations_table, differences_table, load_sweep, points_table
from kdexp.report.plots import curve_series, seed_values, write_plots
from kdexp.report.ranges import METRIC_RANGES, clipped, t_factor, valid_range
from kdexp.report.stats import summarize
from kdexp.report.document import write_report
from sweeps import tiny_config, write_run_dir

# t(0.975, 1) = tan(pi * (0.975 - 0.5)) (the Cauchy quantile); t(0.975, 2) = (2q-1) sqrt(2 / (4q(1-q)))
T1 = math.tan(math.pi * 0.475)
T2 = (2 * 0.975 - 1) * math.sqrt(2 / (4 * 0.975 * 0.025))


def hand(values):
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, sd


def write_sweep(root, finals: dict, statuses: dict | None = None, alphas_typed=("0.5", "1.0")):
    """finals: (alpha text, seed) -> final metrics; a (alpha, seed) in ``statuses`` = 'running' has no summary."""
    num = 0
    for (alpha, seed), final in finals.items():
        config = tiny_config(float(alpha), "topk")
        config["trainer"]["seed"] = seed
        running = (statuses or {}).get((alpha, seed)) == "running"
        val = [{"step": 2, **{k: v + 0.5 for k, v in final.items()}}, {"step": 4, **final}]
        write_run_dir(root / str(num), overrides=[f"balancer.alpha={alpha}", f"trainer.seed={seed}"], config=config,
                      num=num, final=None if running else final, steps=4, val=val[:1] if running else val)
        num += 1
    return root


def test_t_factors_and_the_range_table():
    assert t_factor(2) == pytest.approx(T1, rel=1e-10) and round(T1, 1) == 12.7
    assert t_factor(3) == pytest.approx(T2, rel=1e-10)
    assert valid_range("val/kl_to_teacher") == (0.0, math.inf)
    assert valid_range("val/top1_agreement") == valid_range("train/kept_mass") == (0.0, 1.0)
    assert valid_range("cost/device_hours") == (0.0, math.inf) and valid_range("something/else") is None
    assert all(lo < hi for lo, hi in METRIC_RANGES.values())


def test_two_seeds_withhold_the_interval_and_say_why(tmp_path):
    kl = {("0.5", 1): 0.2, ("0.5", 2): 1.1, ("1.0", 1): 0.5, ("1.0", 2): 0.7}
    sweep = load_sweep(write_sweep(tmp_path / "s", {k: {"val/kl_to_teacher": v, "val/top1_agreement": 0.3}
                                                    for k, v in kl.items()}))
    table = configurations_table(sweep)
    row = dict(zip(table.columns, table.text[0]))
    mean, sd = hand([0.2, 1.1])
    assert row["val/kl_to_teacher"] == f"{mean:.4f} ± {sd:.4f} (n=2†: no interval)"
    # without the rule the interval would be mean ± 12.7 sd / sqrt(2): [-5.07, 6.37] for a KL
    assert mean - T1 * sd / math.sqrt(2) < -5
    raw = dict(zip(table.columns, table.rows[0]))["val/kl_to_teacher"]
    assert raw.small_n and raw.lo is None and raw.std == pytest.approx(sd)
    assert any("t(0.975, 1) = 12.7" in n for n in table.notes)
    diffs = differences_table(sweep)
    assert any(t[5].endswith("†") for t in diffs.text) and any("n = 2" in n for n in diffs.notes)
    files = write_report(sweep, tmp_path / "out")
    assert "t(0.975, 1) = 12.7" in files.markdown.read_text() and "t(0.975, 1) = 12.7" in files.html.read_text()


def test_intervals_are_clipped_to_the_metric_range(tmp_path):
    kl = [0.01, 0.02, 0.30]  # mean 0.11: the symmetric interval runs below 0
    agree = [0.90, 0.99, 1.00]  # mean 0.9633: the interval runs above 1
    finals = {("0.5", s): {"val/kl_to_teacher": k, "val/top1_agreement": a} for s, k, a in zip((1, 2, 3), kl, agree)}
    finals.update({("1.0", s): {"val/kl_to_teacher": 0.5 + s / 100, "val/top1_agreement": 0.5} for s in (1, 2, 3)})
    sweep = load_sweep(write_sweep(tmp_path / "s", finals))
    table = configurations_table(sweep)
    row, raw = dict(zip(table.columns, table.text[0])), dict(zip(table.columns, table.rows[0]))
    m, sd = hand(kl)
    half = T2 * sd / math.sqrt(3)
    assert m - half < 0  # what an unclipped interval would claim
    assert (raw["val/kl_to_teacher"].lo, raw["val/kl_to_teacher"].hi) == (0.0, pytest.approx(m + half))
    assert row["val/kl_to_teacher"] == f"{m:.4f} ± {sd:.4f} [0.0000, {m + half:.4f}] (clipped to [0, ∞))"
    m, sd = hand(agree)
    half = T2 * sd / math.sqrt(3)
    assert m + half > 1
    assert raw["val/top1_agreement"].hi == 1.0 and raw["val/top1_agreement"].lo == pytest.approx(m - half)
    assert row["val/top1_agreement"].endswith("(clipped to [0, 1])")
    assert any("val/kl_to_teacher in [0, ∞)" in n and "val/top1_agreement in [0, 1]" in n for n in table.notes)
    # a mean no correct run can produce is flagged, never clipped
    s = clipped("val/top1_agreement", summarize([1.2, 1.3, 1.4]))
    assert s.out_of_range and s.mean == pytest.approx(1.3)


def test_exact_ties_are_ties(tmp_path):
    root = tmp_path / "s"
    for i, alpha in enumerate(("0.0", "0.5", "1.0")):
        write_run_dir(root / str(i), overrides=[f"balancer.alpha={alpha}"], config=tiny_config(float(alpha), "topk"),
                      num=i, final={"val/top1_agreement": 0.0, "val/lm_loss": 3.0 - i}, steps=4)
    sweep = load_sweep(root)
    best = best_points(sweep)
    assert best["val/top1_agreement"].tied and len(best["val/top1_agreement"].points) == 3
    line = next(x for x in best_lines(best) if x.startswith("val/top1_agreement"))
    assert "tie - 3 configurations share 0.0000 exactly" in line and "no best" in line
    assert "at " not in line.split("exactly")[0]  # no single point named as the best
    table = points_table(sweep)
    col = table.columns.index("val/top1_agreement")
    assert {(r, col) for r in range(3)} <= table.bold  # all three or none: never one of equals
    assert not best["val/lm_loss"].tied and best["val/lm_loss"].point.label == "balancer.alpha=1.0"


def test_typed_values_running_replicates_and_every_seed(tmp_path):
    finals = {(a, s): {"val/lm_loss": 3.0 + s / 10 + (a == "1.0")} for a in ("0.5", "1.0") for s in (1, 2, 3)}
    sweep = load_sweep(write_sweep(tmp_path / "s", finals, statuses={("1.0", 3): "running"}))
    # `1.0` typed stays `1.0` in every table, label and legend
    table = configurations_table(sweep)
    assert [t[0] for t in table.text] == ["balancer.alpha=0.5", "balancer.alpha=1.0"]
    assert [t[1] for t in table.text] == ["0.5", "1.0"]
    assert dict(zip(table.columns, table.text[1]))["n"] == "2/3"
    assert points_table(sweep).text[3][1] == "1.0"
    series = curve_series(sweep, "val/lm_loss")
    running = [s for s in series if s.kind == "running"]
    assert [s.label for s in running] == ["balancer.alpha=1.0, seed=3 [running]"]
    mean = next(s for s in series if s.kind == "mean" and s.label.startswith("balancer.alpha=1.0"))
    assert mean.label == "balancer.alpha=1.0 (n=2)"
    # the mean is over the two finished seeds only (step 4: 4.1 and 4.2), never the running one
    assert dict(zip(mean.steps, mean.values))[4] == pytest.approx((4.1 + 4.2) / 2)
    assert mean.band is None  # 2 finished seeds: no band
    full = next(s for s in series if s.kind == "mean" and s.label.startswith("balancer.alpha=0.5"))
    m, sd = hand([3.1, 3.2, 3.3])
    assert full.band is not None and dict(zip(full.band[0], full.band[1]))[4] == pytest.approx(
        m - T2 * sd / math.sqrt(3))
    assert sum(s.kind == "seed" for s in series) == 5  # each finished seed drawn
    alpha1 = [p for p in sweep.finished if p.params["balancer.alpha"] == 1.0]
    assert sorted(v for _, v in seed_values(alpha1, "balancer.alpha", "val/lm_loss")) == pytest.approx([4.1, 4.2])
    plots = write_plots(sweep, tmp_path / "out")
    assert {"curves", "vs balancer.alpha"} <= set(plots)
