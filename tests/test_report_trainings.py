"""Each training counted once, a folder of sweeps merged or refused, --pairs with Holm, and one-time cost shared.

Hand-made records (tests/sweeps.py, written as the trainer writes them) for the rules, and one real sweep with its
rerun under one folder (python -m kdexp.run -m, the smoke config at 2 steps) for the whole path; the statistics are
checked against scipy (paired t test, its t quantiles) and Holm's procedure done by hand.
"""
from __future__ import annotations

import math
import statistics
import shutil
from pathlib import Path

import pytest
from scipy import stats as sps

from _launch import kdexp_run
from kdexp.report import load_sweep
from kdexp.report.__main__ import main
from kdexp.report.replicates import configurations
from kdexp.report.stats import MAX_SEEDS, holm, seeds_needed
from kdexp.track import records
from sweeps import tiny_config, write_run_dir

KL = "val/kl_to_teacher"


def _point(root: Path, num: int, alpha: float, seed: int, kl: float, *, extra: tuple[str, ...] = (),
           **kwargs) -> Path:
    config = tiny_config(alpha, "topk")
    config["trainer"]["seed"] = seed
    overrides = [*extra, f"balancer.alpha={alpha}", f"trainer.seed={seed}"]
    return write_run_dir(root / str(num), overrides=overrides, config=config, num=num, steps=4,
                         **({"final": {KL: kl}} if "error" not in kwargs else {}), **kwargs)


def _sweep_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    records.write_json(root / records.SWEEP, {"points": []})
    return root


# ---------------------------------------------------------------------------------------------------------------------
def test_a_failed_attempt_is_superseded_by_the_run_that_trained_it(tmp_path):
    a, b = _sweep_dir(tmp_path / "d" / "a"), _sweep_dir(tmp_path / "d" / "b")
    _point(a, 0, 0.5, 1, 0.0, error="RuntimeError: killed")
    (a / "0" / records.RUN).write_text('{"config_hash": "%s"}' % records.read_json(
        _point(b, 0, 0.5, 1, 0.9) / records.SUMMARY)["config_hash"])  # run.json: what a/0 set out to train
    _point(b, 1, 0.5, 2, 1.1)
    sweep = load_sweep(tmp_path / "d")
    assert [p.name for p in sweep.points] == ["b/0", "b/1"] and sweep.counts()["failed"] == 0
    assert sweep.duplicates == [("a/0", "b/0", "an earlier failed attempt, superseded")]
    assert sweep.merged == ["a", "b"]


def test_sweeps_whose_common_settings_differ_are_refused(tmp_path, capsys):
    a, b = _sweep_dir(tmp_path / "d" / "a"), _sweep_dir(tmp_path / "d" / "b")
    for seed in (1, 2):
        _point(a, seed, 0.5, seed, 1.0, extra=("trainer.max_steps=2",))
        _point(b, seed, 0.5, seed, 1.0, extra=("trainer.max_steps=4",))
    with pytest.raises(ValueError, match=r"2 sweeps whose common settings differ \(trainer.max_steps=2 in a, "
                                         r"trainer.max_steps=4 in b\)"):
        load_sweep(tmp_path / "d")
    assert main([str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report each sweep dir on its own" in err[0]
    # a setting one sweep holds and the other sweeps is no conflict: the merge shows it as swept
    c = _sweep_dir(tmp_path / "e" / "c")
    shutil.copytree(a, tmp_path / "e" / "a")
    for i, steps in enumerate((2, 4)):
        _point(c, i, 0.5, 1, 1.0, extra=(f"trainer.max_steps={steps}",))
    sweep = load_sweep(tmp_path / "e")
    assert sweep.merged == ["a", "c"] and "trainer.max_steps" in sweep.swept


def test_holm_by_hand_and_seeds_needed_against_the_formula():
    p = [0.01, 0.04, 0.03, None, 0.2, math.nan]
    # sorted 0.01, 0.03, 0.04, 0.2 (m = 4): 4 x 0.01, max(., 3 x 0.03), max(., 2 x 0.04), max(., 1 x 0.2)
    assert holm(p) == pytest.approx([0.04, 0.09, 0.09, None, 0.2, None])
    assert holm([0.5, 0.9]) == [1.0, 1.0]  # 2 x 0.5 = 1; then max(1, 0.9): never below an earlier step
    for sd, delta, alpha, power in ((1.0, 1.0, 0.05, 0.8), (1.0, 0.5, 0.05, 0.8), (0.3, 0.1, 0.05 / 18, 0.8),
                                    (2.0, 0.7, 0.01, 0.9)):
        n = seeds_needed(sd, delta, alpha=alpha, power=power)

        def enough(k: int) -> bool:
            return k >= ((sps.t.ppf(1 - alpha / 2, k - 1) + sps.t.ppf(power, k - 1)) * sd / delta) ** 2

        assert enough(n) and (n == 2 or not enough(n - 1)), (sd, delta, n)
    # the textbook numbers (paired t, two-sided 5%, 80% power): d = 1 -> 10 pairs, d = 0.5 -> 34 (G*Power: 34)
    assert seeds_needed(1.0, 1.0) == 10 and seeds_needed(1.0, 0.5) == 34
    assert seeds_needed(0.0, 0.1) == 2 and seeds_needed(1.0, 0.0) is None


# ---------------------------------------------------------------------------------------------------------------------
SMOKE = ("experiment=smoke", "logger=none", "trainer.max_steps=2", "trainer.eval_interval=2", "trainer.eval_iters=1",
         "trainer.checkpoint_interval=2", "model.teacher_pretrain_steps=4")


def _multirun(env, sweep_dir: Path, *overrides: str) -> None:
    kdexp_run(["-m", *SMOKE, *overrides, f"hydra.sweep.dir={sweep_dir}"], env, sweep_dir.parent, timeout=1800)


@pytest.fixture(scope="module")
def rerun(env, tmp_path_factory):
    """multirun/<date>/ as a user has it after a sweep and its rerun with one more seed: a (alpha 0.5, 1.0 x seeds
    1, 2) and b (the same x seeds 1, 2, 3: four points reused from a, two trained)."""
    root = tmp_path_factory.mktemp("rerun") / "multirun"
    root.mkdir()
    _multirun(env, root / "a", "balancer.alpha=0.5,1.0", "trainer.seed=1,2")
    _multirun(env, root / "b", "balancer.alpha=0.5,1.0", "trainer.seed=1,2,3")
    return root


def _finals(run_dirs: list[Path]) -> dict[tuple[float, int], float]:
    """(alpha, seed) -> final KL, read from the summaries the trainer wrote (not through the report)."""
    out = {}
    for d in run_dirs:
        s = records.read_json(d / records.SUMMARY)
        o = records.parse_overrides(s["overrides"])
        out[(float(o["balancer.alpha"]), int(o["trainer.seed"]))] = s["final"][KL]
    return out


@pytest.mark.slow
def test_a_sweep_and_its_rerun_count_each_training_once(rerun, capsys):
    reused = sorted(p.parent.name for p in (rerun / "b").glob("*/summary.json")
                    if records.read_json(p).get("reused_from"))
    assert len(reused) == 4  # the rerun trained only seed 3
    sweep = load_sweep(rerun)
    assert sweep.merged == ["a", "b"] and len(sweep.points) == 6 and len(sweep.duplicates) == 4
    assert all(why == "reuses it" and copy.startswith("b/") and kept.startswith("a/")
               for copy, kept, why in sweep.duplicates)
    for c in configurations(sweep):
        assert sorted(p.seed for p in c.finished) == [1, 2, 3]  # not 1 1 2 2 3
    # the trainings: a's four and b's seed 3; the paired test over them, by scipy
    trained = [d for d in sorted((rerun / "a").glob("[0-9]*")) + sorted((rerun / "b").glob("[0-9]*"))
               if not records.read_json(d / records.SUMMARY).get("reused_from")]
    finals = _finals(trained)
    assert len(finals) == 6
    x, y = ([finals[(alpha, s)] for s in (1, 2, 3)] for alpha in (0.5, 1.0))
    expected = sps.ttest_rel(x, y)

    assert main([str(rerun), "--pairs", "alpha=0.5:alpha=1.0", "--metric", KL]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {KL} "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["balancer.alpha=0.5", "balancer.alpha=1.0", "3"]
    assert float(cells[4]) == pytest.approx(sum(x) / 3 - sum(y) / 3, abs=1e-4)
    p_shown = cells[7]
    assert p_shown == "<0.0001" if expected.pvalue < 1e-4 else float(p_shown) == pytest.approx(expected.pvalue,
                                                                                                 abs=1e-4)
    # the whole report of the folder, and the live page (same loader): 6 points, the merge named
    assert main([str(rerun), "--out", str(rerun.parent / "report")]) == 0
    md = (rerun.parent / "report" / "report.md").read_text()
    assert "6 points: 6 finished (10 run dirs: 4 hold a training another run dir holds, counted once)" in md
    assert "Merged 2 sweeps (their common settings agree): a, b" in md
    assert "| 3/3 | 1 2 3 |" in md
    assert md.count("counted once with b/") == 4


@pytest.mark.slow
def test_pairs_family_is_holm_corrected_as_scipy_and_hand_give_it(rerun, capsys):
    metrics = ("val/kl_to_teacher", "val/lm_loss", "val/top1_agreement")
    argv = [str(rerun), "--pairs", "balancer.alpha=0.5:balancer.alpha=1.0", "alpha=1.0:alpha=0.5"]
    for m in metrics:
        argv += ["--metric", m]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| val/")]
    assert len(rows) == 6 and "p Holm (m=6)" in out and "Holm's step-down correction over the 6" in out
    trained = [d for d in sorted(rerun.glob("[ab]/[0-9]*"))
               if not records.read_json(d / records.SUMMARY).get("reused_from")]
    raw = []
    for s_a, s_b in ((0.5, 1.0), (1.0, 0.5)):
        for m in metrics:
            vals = {}
            for d in trained:
                s = records.read_json(d / records.SUMMARY)
                o = records.parse_overrides(s["overrides"])
                vals[(float(o["balancer.alpha"]), int(o["trainer.seed"]))] = s["final"][m]
            a = [vals[(s_a, k)] for k in (1, 2, 3)]
            b = [vals[(s_b, k)] for k in (1, 2, 3)]
            raw.append(sps.ttest_rel(a, b).pvalue)
    order = sorted(range(6), key=lambda i: raw[i])
    by_hand, running = [0.0] * 6, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (6 - rank) * raw[i]))
        by_hand[i] = running
    for row, p, ph in zip(rows, raw, by_hand):
        for shown, want in ((row[7], p), (row[8], ph)):
            assert shown == "<0.0001" if want < 1e-4 else float(shown) == pytest.approx(want, abs=1e-4)
        assert row[9] == ("**significant**" if ph < 0.05 else "not significant")
    # a name that is no configuration: one line, exit 2
    assert main([str(rerun), "--pairs", "alpha=0.7:alpha=1.0"]) == 2
    assert "names no configuration" in capsys.readouterr().err


@pytest.mark.slow
def test_the_teacher_pretraining_is_shared_over_the_points_that_used_it(rerun):
    sweep = load_sweep(rerun)
    work = {w.path: w for w in sweep.one_time}
    # one teacher for the whole sweep: the embedded teacher is keyed by its own seed, not trainer.seed
    assert len(work) == 1 and all(w.what == "teacher pretraining" for w in work.values())
    (w,) = work.values()
    assert len(w.users) == len(sweep.points) == 6 and w.built_by in w.users and w.device_hours > 0
    build = records.read_json(Path(w.path) / "build.json")
    assert build["device_hours"] == pytest.approx(build["wall_s"] / 3600) and build["tokens"] > 0
    for p in sweep.points:
        c = p.cost
        pre = next(e for e in c["one_time"] if e["what"] == "teacher pretraining")
        share = pre["build"]["device_hours"] / 6
        own = c["device_hours"] - (pre["build"]["device_hours"] if pre["built_here"] else 0.0)
        assert p.final["cost/device_hours"] == pytest.approx(own)
        assert p.final["cost/one_time_device_hours"] == pytest.approx(share)
        assert p.final["cost/total_device_hours"] == pytest.approx(own + share)


ABLATION_ARMS = ("k8_renorm", "k8_ghost", "topp_k8", "k32_renorm", "k32_ghost", "topp_k32", "k128_renorm",
                 "k128_ghost", "topp_k128")
# docs/ablation.md's command, as printed there (the sweep dir aside)
ABLATION_PAIRS = ("k8_ghost:k8_renorm", "topp_k8:k8_ghost", "k32_ghost:k32_renorm", "topp_k32:k32_ghost",
                  "k128_ghost:k128_renorm", "topp_k128:k128_ghost")


def _arm_seed_sweep(root: Path, experiment: str, arms, final) -> dict[tuple[str, int], dict[str, float]]:
    """A sweep dir of `experiment`'s arms x seeds 1-5, records as the trainer writes them; ``final(arm_i, seed)``: a
    point's final metrics. Returns them by (arm, seed)."""
    values, num = {}, 0
    for arm_i, arm in enumerate(arms):
        for seed in range(1, 6):
            values[(arm, seed)] = final(arm_i, seed)
            config = {**tiny_config(1.0, "topk", arm=arm), "trainer": {"seed": seed, "max_steps": 4}}
            write_run_dir(root / str(num), overrides=[f"experiment={experiment}", f"arm={arm}", f"trainer.seed={seed}"],
                          config=config, choices={"arm": arm}, num=num, steps=4, final=values[(arm, seed)])
            num += 1
    return values


def _pairs_rows(capsys) -> list[list[str]]:
    """The cells of each row of the --pairs table just printed."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| val/")]


def _holm_by_hand(raw: list[float]) -> list[float]:
    """Holm's step-down adjusted p values, by hand: the k-th smallest times (m - k + 1), never below the one before."""
    running, out = 0.0, [0.0] * len(raw)
    for rank, i in enumerate(sorted(range(len(raw)), key=lambda i: raw[i])):
        running = max(running, min(1.0, (len(raw) - rank) * raw[i]))
        out[i] = running
    return out


def test_ablation_pairs_command_on_its_arms(tmp_path, capsys):
    """docs/ablation.md's --pairs over a sweep shaped like ghost_vs_renorm (9 arms x 5 seeds, records as the trainer
    writes them): 18 rows in the order asked, p as scipy's paired t test gives it, Holm over the 18 by hand."""
    import random

    rng = random.Random(7)
    root = _sweep_dir(tmp_path / "ghost_vs_renorm")
    values = _arm_seed_sweep(root, "ghost_vs_renorm", ABLATION_ARMS, lambda arm_i, seed: {
        "val/kl_to_teacher": 1.0 + 0.05 * arm_i + rng.gauss(0, 0.05) + 0.1 * seed,
        "val/lm_loss": 4.0 + 0.02 * arm_i + rng.gauss(0, 0.05), "val/top1_agreement": 0.4 + rng.gauss(0, 0.02)})
    assert main([str(root), "--pairs", *ABLATION_PAIRS]) == 0
    rows = _pairs_rows(capsys)
    metrics = ("val/kl_to_teacher", "val/lm_loss", "val/top1_agreement")
    assert [(r[0], r[1], r[2]) for r in rows] == [(m, *pair.split(":")) for pair in ABLATION_PAIRS for m in metrics]
    raw = [sps.ttest_rel([values[(a, s)][m] for s in range(1, 6)], [values[(b, s)][m] for s in range(1, 6)]).pvalue
           for pair in ABLATION_PAIRS for a, b in [pair.split(":")] for m in metrics]
    by_hand = _holm_by_hand(raw)
    diffs = [[values[(a, s)][m] - values[(b, s)][m] for s in range(1, 6)]
             for pair in ABLATION_PAIRS for a, b in [pair.split(":")] for m in metrics]
    for row, p, ph, d in zip(rows, raw, by_hand, diffs):
        assert row[3] == "5"
        for shown, want in ((row[7], p), (row[8], ph)):
            assert shown == "<0.0001" if want < 1e-4 else float(shown) == pytest.approx(want, abs=1e-4)
        assert row[9] == ("**significant**" if ph < 0.05 else "not significant")
        sd, delta = statistics.stdev(d), statistics.fmean(d)
        assert float(row[6]) == pytest.approx(sd, abs=1e-4) and float(row[4]) == pytest.approx(delta, abs=1e-4)
        need = seeds_needed(sd, delta, alpha=0.05 / 18)
        assert row[10] == (f">{MAX_SEEDS}" if need > MAX_SEEDS else str(need))
    # the same comparisons named by key=value, the arm key written out
    assert main([str(root), "--pairs", "arm=k8_ghost:arm=k8_renorm", "--metric", KL]) == 0
    assert "| k8_ghost | k8_renorm | 5 |" in capsys.readouterr().out


def test_on_policy_pairs_command_on_its_arms(tmp_path, capsys, monkeypatch):
    """docs/on-policy.md's --pairs command as printed, over a sweep dir shaped like experiment=on_vs_off_policy
    (5 arms x 5 seeds; val/onpolicy_reverse_kl logged as every run logs it): its 10 rows in the order asked, p as
    scipy's paired t test gives it, Holm over the 10."""
    import random
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "on-policy.md").read_text()
    block = re.search(r"<!-- covered: tests/test_report_trainings.py::test_on_policy_pairs_command_on_its_arms -->\n"
                      r"```bash\n(.+?)\n```", text).group(1)
    argv = shlex.split(block)
    assert argv[:3] == ["python", "-m", "kdexp.report"]
    rng = random.Random(11)
    root = _sweep_dir(tmp_path / argv[3])
    arms = ("op_off", "op_ghost", "op_renorm", "op_sampled_token", "op_mix")
    values = _arm_seed_sweep(root, "on_vs_off_policy", arms, lambda arm_i, seed: {
        "val/kl_to_teacher": 2.0 + 0.1 * arm_i + rng.gauss(0, 0.05),
        "val/onpolicy_reverse_kl": 1.9 + 0.2 * arm_i * (arm_i % 2) + rng.gauss(0, 0.05),
        "val/lm_loss": 5.0 + rng.gauss(0, 0.05), "val/top1_agreement": 0.25 + rng.gauss(0, 0.01)})
    monkeypatch.chdir(tmp_path)
    assert main(argv[3:]) == 0
    rows = _pairs_rows(capsys)
    pairs = [a.split(":") for a in argv[argv.index("--pairs") + 1:argv.index("--metric")]]
    metrics = ("val/onpolicy_reverse_kl", "val/kl_to_teacher")
    assert [(r[0], r[1], r[2]) for r in rows] == [(m, a, b) for a, b in pairs for m in metrics]
    raw = [sps.ttest_rel([values[(a, s)][m] for s in range(1, 6)], [values[(b, s)][m] for s in range(1, 6)]).pvalue
           for a, b in pairs for m in metrics]
    for row, p, ph in zip(rows, raw, _holm_by_hand(raw)):
        for shown, want in ((row[7], p), (row[8], ph)):
            assert shown == "<0.0001" if want < 1e-4 else float(shown) == pytest.approx(want, abs=1e-4)
        assert row[9] == ("**significant**" if ph < 0.05 else "not significant")
