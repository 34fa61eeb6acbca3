"""Replicates in the report: hand-made run dirs of 3 arms x 3 seeds with known numbers, checked against a float64
hand computation (t_{0.975,2} from its closed form), through the tables, the best lines, report.md/index.html, the
W&B-sourced report (a fake API holding the same runs) and the notebook."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kdexp.report import load_sweep, load_wandb_group, write_report
from kdexp.report.comparisons import configurations_table, differences_table
from kdexp.report.plots import mean_curve
from kdexp.report.replicates import configurations
from kdexp.report.tables import best_lines, best_points, points_table
from sweeps import REPO, tiny_config, write_run_dir
from test_report import FakeApi, FakeRun, png_size

SEEDS = (1, 2, 3)
ARMS = ("before", "after", "top_p")
# metric -> arm -> one value per seed
VALUES = {
    "val/lm_loss": {"before": (3.40, 3.10, 3.60), "after": (3.00, 2.75, 3.25), "top_p": (3.05, 3.15, 3.20)},
    "val/kl_to_teacher": {"before": (0.8, 0.7, 0.9), "after": (0.30, 0.25, 0.35), "top_p": (0.5, 0.42, 0.6)},
    "val/top1_agreement": {a: (0.5, 0.6, 0.55) for a in ARMS},  # identical arms: difference exactly 0
    "train/kept_mass": {a: (0.9, 0.9, 0.9) for a in ARMS},
    "perf/tokens_per_s": {"before": (900.0, 1500.0, 1000.0), "after": (2000.0, 2100.0, 1900.0),
                          "top_p": (100.0, 120.0, 110.0)},
}
T975_2 = (2 * 0.975 - 1) * math.sqrt(2 / (4 * 0.975 * 0.025))  # df=2 closed form (2q-1) sqrt(2/(4q(1-q))) = 4.3027


def arm_config(arm: str, seed: int) -> dict:
    loss = {"before": "renorm_topk", "after": "topk", "top_p": "top_p"}[arm]
    config = tiny_config(0.9, loss, arm=arm)
    config["balancer"]["name"] = "dynamic" if arm == "before" else "alpha"
    config["trainer"]["seed"] = seed
    return config


def final(arm: str, i: int) -> dict:
    return {m: VALUES[m][arm][i] for m in VALUES}


def make_replicate_sweep(root):
    num = 0
    for arm in ARMS:
        for i, seed in enumerate(SEEDS):
            f = final(arm, i)
            val = [{"step": 2, **{m: v + 0.1 * seed for m, v in f.items() if m.startswith("val/")}},
                   {"step": 4, **{m: v for m, v in f.items() if m.startswith("val/")}}]
            write_run_dir(root / str(num), overrides=["experiment=qwen3_before_after", f"arm={arm}",
                                                      f"trainer.seed={seed}"],
                          config=arm_config(arm, seed), choices={"arm": arm, "experiment": "qwen3_before_after"},
                          num=num, final=f, steps=4, val=val,
                          train=[{"step": s, "train/loss": 4.0 - s * 0.1 * seed} for s in (1, 2, 3, 4)])
            num += 1
    return root


def hand(values) -> tuple[float, float, float, float]:
    """mean, std (ddof 1), lo, hi in float64 with numpy: the reference."""
    x = np.asarray(values, dtype=np.float64)
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    half = T975_2 * sd / math.sqrt(len(x))
    return mean, sd, mean - half, mean + half


def hand_paired(a, b) -> tuple[float, float, float, float]:
    """mean difference, lo, hi, p of the paired t test (df=2: p = 1 - |t|/sqrt(2+t^2))."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / math.sqrt(len(d))
    t = mean / se
    return mean, mean - T975_2 * se, mean + T975_2 * se, 1 - abs(t) / math.sqrt(2 + t * t)


@pytest.fixture()
def rep(tmp_path):
    return make_replicate_sweep(tmp_path / "rep")


def test_configurations_over_seeds(rep):
    sweep = load_sweep(rep)
    assert sweep.seed_key == "trainer.seed" and sweep.config_keys == ["arm"]
    assert [p.seed for p in sweep.points] == list(SEEDS) * 3
    configs = configurations(sweep)
    assert [c.arm for c in configs] == list(ARMS) and [len(c.points) for c in configs] == [3, 3, 3]
    table = configurations_table(sweep)
    assert table.columns[:4] == ["configuration", "arm", "n", "seeds"]
    for r, arm in enumerate(ARMS):
        row = dict(zip(table.columns, table.rows[r]))
        text = dict(zip(table.columns, table.text[r]))
        assert (row["n"], row["seeds"], text["n"], text["seeds"]) == (3, [1, 2, 3], "3/3", "1 2 3")
        for metric, by_arm in VALUES.items():
            s = row[metric]
            mean, sd, lo, hi = hand(by_arm[arm])
            assert s.n == 3
            assert [s.mean, s.std, s.lo, s.hi] == pytest.approx([mean, sd, lo, hi], rel=1e-12, abs=1e-12), metric
            shown = f"{mean:.1f} ± {sd:.1f}" if abs(mean) >= 100 else f"{mean:.4f} ± {sd:.4f}"
            assert text[metric].startswith(shown), (metric, text[metric])
    lm = table.columns.index("val/lm_loss")
    assert (1, lm) in table.bold  # "after" has the lowest mean
    assert not any(c == table.columns.index("perf/tokens_per_s") for _, c in table.bold)  # never ranked
    assert not points_table(sweep).bold  # with replicates no single seed is marked best


def test_paired_differences_and_verdicts(rep):
    table = differences_table(load_sweep(rep))
    rows = {(r[0], r[1]): dict(zip(table.columns, r)) for r in table.rows}
    text = {(t[0], t[1]): dict(zip(table.columns, t)) for t in table.text}
    assert not any(m.startswith("perf/") for m, _ in rows)  # timing is never compared
    assert {m for m, _ in rows} == {"val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/kept_mass"}
    for (metric, arm), row in rows.items():
        assert row["vs"] == "arm=before" and arm in ("arm=after", "arm=top_p")
        a, b = VALUES[metric][arm.split("=")[1]], VALUES[metric]["before"]
        if len(set(np.subtract(a, b).round(12))) == 1:  # identical arms / constant shift: std 0
            continue
        mean, lo, hi, p = hand_paired(a, b)
        assert row["difference"] == pytest.approx(mean, abs=1e-12)
        assert row["95% interval"] == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
        assert row["p"] == pytest.approx(p, rel=1e-9)
        assert row["verdict"] is (p < 0.05)
        assert row["method"] == "paired by seed (n=3)"
    assert rows[("val/lm_loss", "arm=after")]["verdict"] is True  # -0.40, -0.35, -0.35: every seed better
    assert rows[("val/lm_loss", "arm=top_p")]["verdict"] is False
    assert text[("val/lm_loss", "arm=top_p")]["verdict"] == "not significant at 95%"
    assert text[("val/lm_loss", "arm=after")]["verdict"] == "significant at 95%"
    same = rows[("val/top1_agreement", "arm=after")]
    assert (same["difference"], same["p"], same["verdict"]) == (0.0, 1.0, False)


def test_best_lines_say_when_not_significant(rep):
    best = best_points(load_sweep(rep))
    assert set(best) == {"val/lm_loss", "val/kl_to_teacher", "val/top1_agreement"}  # no perf/*, no kept mass
    lm = best["val/lm_loss"].ranking
    assert lm.best.label == "arm=after" and lm.runner_up.label == "arm=top_p"
    mean, lo, hi, p = hand_paired(VALUES["val/lm_loss"]["after"], VALUES["val/lm_loss"]["top_p"])
    assert lm.difference.mean == pytest.approx(mean) and lm.difference.p == pytest.approx(p, rel=1e-9)
    assert lm.significant is False
    kl = best["val/kl_to_teacher"].ranking
    assert kl.best.label == "arm=after" and kl.significant is True  # -0.2, -0.17, -0.25: p = 0.0125
    assert kl.difference.p == pytest.approx(hand_paired(VALUES["val/kl_to_teacher"]["after"],
                                                        VALUES["val/kl_to_teacher"]["top_p"])[3], rel=1e-9)
    lines = {line.split(" (")[0]: line for line in best_lines(best)}
    m, sd, lo_, hi_ = hand(VALUES["val/lm_loss"]["after"])
    assert lines["val/lm_loss"].startswith(
        f"val/lm_loss (lowest is best): {m:.4f} ± {sd:.4f} [{lo_:.4f}, {hi_:.4f}] (n=3) at arm=after"
        " - NOT significantly better than the runner-up arm=top_p (")
    assert f"difference {mean:+.4f} [{lo:+.4f}, {hi:+.4f}], paired by seed (n=3), p={p:.4f}" in lines["val/lm_loss"]
    assert " - significantly better than the runner-up arm=top_p" in lines["val/kl_to_teacher"]
    # identical arms: a tie of all three, reported as one, never a best arm
    assert lines["val/top1_agreement"] == ("val/top1_agreement (highest is best): tie - 3 configurations share 0.5500 "
                                           "exactly (arm=before; arm=after; arm=top_p): no best")
    assert best["val/top1_agreement"].tied and best["val/top1_agreement"].ranking.significant is None


def test_report_files_with_replicates(rep, tmp_path):
    files = write_report(load_sweep(rep), tmp_path / "out")
    md, page = files.markdown.read_text(), files.html.read_text()
    assert "## Configurations (mean ± std over seeds [95% Student-t interval])" in md
    assert "## Paired differences" in md and "| val/lm_loss | arm=after | arm=before |" in md
    assert "perf/tokens_per_s (machine-dependent)" in md and "NOT significantly better" in md
    assert "significant = their 95% interval excludes 0" in md
    assert 'http-equiv="refresh"' not in page  # every point ended: the final page
    assert set(files.plots) == {"curves", "arms", "vs arm"}  # no plot against the seed
    for path in files.plots.values():
        assert png_size(path)[0] > 200


def test_mean_curve_bands(rep):
    after = [p for p in load_sweep(rep).points if p.arm == "after"]
    curve = dict(mean_curve(after, "val/lm_loss"))
    step2 = [v + 0.1 * s for v, s in zip(VALUES["val/lm_loss"]["after"], SEEDS)]
    assert curve[2].mean == pytest.approx(hand(step2)[0]) and curve[2].lo == pytest.approx(hand(step2)[2])
    assert curve[4].hi == pytest.approx(hand(VALUES["val/lm_loss"]["after"])[3])


def test_wandb_sourced_report_has_the_same_configurations(rep):
    runs = []
    for arm in ARMS:
        for i, seed in enumerate(SEEDS):
            f = final(arm, i)
            runs.append(FakeRun(f"fox-{len(runs)}", "finished", arm_config(arm, seed), {**f, "_step": 4},
                                [{"_step": 4, **f}]))
    wb = load_wandb_group("g", project="p", api=FakeApi(runs))
    assert wb.seed_key == "trainer.seed" and wb.config_keys == ["experiment_arm"]
    disk = configurations_table(load_sweep(rep))
    table = configurations_table(wb)
    assert [t[1:] for t in table.text] == [t[1:] for t in disk.text]  # label key differs: experiment_arm vs arm
    diffs = differences_table(wb)
    assert [t[3:] for t in diffs.text] == [t[3:] for t in differences_table(load_sweep(rep)).text]


@pytest.mark.slow
def test_notebook_shows_replicates(rep, tmp_path, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("KDEXP_SWEEP_DIR", str(rep))
    monkeypatch.setenv("KDEXP_REPORT_DIR", str(tmp_path / "nb"))
    nb = nbformat.read(REPO / "notebooks" / "ablation_report.ipynb", as_version=4)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    markdown = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    mean, sd, lo, hi = hand(VALUES["val/lm_loss"]["after"])
    assert f"{mean:.4f} ± {sd:.4f} [{lo:.4f}, {hi:.4f}]" in html  # the configurations table
    assert "not significant at 95%" in html and "significant at 95%" in html  # the paired differences
    assert "NOT significantly better than the runner-up arm=top_p" in markdown


def test_onpolicy_reverse_kl_is_reported_where_the_points_logged_it(tmp_path, monkeypatch, capsys):
    from kdexp.report.__main__ import main as report_main
    from kdexp.report.comparisons import configurations_table as configs_table

    before = load_sweep(make_replicate_sweep(tmp_path / "old"))  # logged before the metric existed: no dashes column
    assert "val/onpolicy_reverse_kl" not in points_table(before).columns
    assert "val/onpolicy_reverse_kl" not in best_points(before)
    onpolicy = {"before": (2.0, 2.2, 2.1), "after": (1.5, 1.6, 1.7), "top_p": (1.9, 2.3, 2.0)}
    monkeypatch.setitem(VALUES, "val/onpolicy_reverse_kl", onpolicy)
    root = make_replicate_sweep(tmp_path / "new")
    sweep = load_sweep(root)
    table = configs_table(sweep)
    assert table.columns.index("val/onpolicy_reverse_kl") == table.columns.index("val/kl_to_teacher") + 1
    best = best_points(sweep)["val/onpolicy_reverse_kl"]  # lower is better
    assert best.ranking.best.label == "arm=after"
    rows = {(r[0], r[1]): dict(zip(differences_table(sweep).columns, r)) for r in differences_table(sweep).rows}
    mean, lo, hi, p = hand_paired(onpolicy["after"], onpolicy["before"])
    assert rows[("val/onpolicy_reverse_kl", "arm=after")]["difference"] == pytest.approx(mean, abs=1e-12)
    assert rows[("val/onpolicy_reverse_kl", "arm=after")]["p"] == pytest.approx(p, rel=1e-9)
    assert report_main([str(root), "--pairs", "arm=after:arm=before"]) == 0  # --pairs' default metrics hold it too
    assert [x for x in capsys.readouterr().out.splitlines() if "val/onpolicy_reverse_kl" in x]
