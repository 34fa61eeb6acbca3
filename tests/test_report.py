"""kdexp.report on hand-made run dirs with known numbers, a fake W&B API, and the CLI as a subprocess."""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kdexp.report import (arms_table, best_points, find_run_dirs, latest_sweep, load_sweep, load_wandb_group,
                          points_table, to_html, to_markdown, write_report)
from kdexp.report.__main__ import main as report_main
from kdexp.report.tables import swept_text
from sweeps import REPO, tiny_config, write_run_dir

# (alpha, loss) -> final val/lm_loss, val/kl_to_teacher, val/top1_agreement, train/kept_mass, perf/tokens_per_s
FINISHED = {(0.0, "topk"): (3.0, 0.5, 0.4, 0.9, 1000.0), (0.5, "topk"): (2.8, 0.3, 0.55, 0.9, 1200.0),
            (1.0, "topk"): (2.9, 0.2, 0.6, 0.9, 900.0), (0.0, "top_p"): (3.1, 0.45, 0.42, 0.95, 1100.0)}
NAMES = ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/kept_mass", "perf/tokens_per_s")
GRID = [(a, loss) for loss in ("topk", "top_p") for a in (0.0, 0.5, 1.0)]  # point num = index
FAILED, RUNNING = (0.5, "top_p"), (1.0, "top_p")


def finished_kwargs(values):
    lm, kl, ag, km, tps = values
    final = dict(zip(NAMES, values), **{"train/loss": lm + 0.1})
    train = [{"step": s, "train/loss": lm + 1.0 / s, "train/kept_mass": km, "perf/tokens_per_s": tps}
             for s in (1, 2, 3, 4)]
    val = [{"step": 2, "val/lm_loss": lm + 0.2, "val/kl_to_teacher": kl + 0.1, "val/top1_agreement": ag - 0.1},
           {"step": 4, "val/lm_loss": lm, "val/kl_to_teacher": kl, "val/top1_agreement": ag}]
    return dict(final=final, steps=4, train=train, val=val)


def make_grid_sweep(root: Path) -> Path:
    for num, (alpha, loss) in enumerate(GRID):
        if (alpha, loss) in FINISHED:
            kw = finished_kwargs(FINISHED[(alpha, loss)])
        elif (alpha, loss) == FAILED:
            kw = dict(error="RuntimeError: boom at step 2", train=[{"step": 1, "train/loss": 5.0}],
                      traceback="Traceback (most recent call last):\n  File \"loop.py\", line 1\n"
                                "RuntimeError: boom at step 2\n")
        else:  # running: its partial val/lm_loss beats every finished point, and must not be picked as best
            kw = dict(train=[{"step": 1, "train/loss": 4.0}, {"step": 2, "train/loss": 3.5}],
                      val=[{"step": 2, "val/lm_loss": 1.0, "val/kl_to_teacher": 0.01, "val/top1_agreement": 0.99}])
        write_run_dir(root / str(num), overrides=["trainer.max_steps=4", f"balancer.alpha={alpha}", f"loss={loss}"],
                      config=tiny_config(alpha, loss), choices={"loss": loss, "balancer": "alpha"}, num=num, **kw)
    return root


@pytest.fixture()
def grid(tmp_path):
    return make_grid_sweep(tmp_path / "sweep")


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature and the chunk's CRC."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert zlib.crc32(data[12:16 + length]) == crc
    assert data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------------------------------
def test_points_table_values_status_and_errors(grid):
    sweep = load_sweep(grid)
    assert sweep.swept == ["balancer.alpha", "loss"]
    assert sweep.fixed == {"trainer.max_steps": "4"}
    table = points_table(sweep)
    assert table.column("point") == [str(i) for i in range(len(GRID))]
    assert table.column("balancer.alpha") == [a for a, _ in GRID]
    assert table.column("loss") == [loss for _, loss in GRID]
    for metric_i, metric in enumerate(NAMES):
        expected = [FINISHED[g][metric_i] if g in FINISHED else None for g in GRID]
        if metric in ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement"):
            expected[GRID.index(RUNNING)] = {"val/lm_loss": 1.0, "val/kl_to_teacher": 0.01,
                                             "val/top1_agreement": 0.99}[metric]
        assert table.column(metric) == expected, metric
    assert table.column("status") == ["finished" if g in FINISHED else "failed" if g == FAILED else "running"
                                      for g in GRID]
    assert table.column("error")[GRID.index(FAILED)] == "RuntimeError: boom at step 2"
    assert table.column("steps") == [4 if g in FINISHED else None for g in GRID]
    running = sweep.points[GRID.index(RUNNING)]
    assert running.final_partial and running.final["train/loss"] == 3.5
    assert running.curves["train/loss"] == [(1, 4.0), (2, 3.5)]
    text = dict(zip(table.columns, table.text[GRID.index(RUNNING)]))
    assert text["status"] == "running (last logged values)"
    assert sweep.points[0].params == {"balancer.alpha": 0.0, "loss": "topk"}


def test_best_points_only_among_finished(grid):
    sweep = load_sweep(grid)
    best = best_points(sweep)
    for metric_i, metric in enumerate(NAMES):
        if metric in ("train/kept_mass", "perf/tokens_per_s"):
            assert metric not in best  # descriptive / machine-dependent: never a "best"
            continue
        pick = max if metric == "val/top1_agreement" else min
        g = pick(FINISHED, key=lambda k: FINISHED[k][metric_i])
        assert best[metric].point.name == str(GRID.index(g)), metric
        assert best[metric].value == FINISHED[g][metric_i]
    table = points_table(sweep)
    md = to_markdown(table)
    assert "| 1 | 0.5 | topk | **2.8000** |" in md  # best lm loss is bold
    assert "<td><b>2.8000</b></td>" in to_html(table)


def test_report_files_markdown_html_pngs(grid, tmp_path):
    files = write_report(load_sweep(grid), grid / "report")
    md, page = files.markdown.read_text(), files.html.read_text()
    assert set(files.plots) == {"curves", "vs balancer.alpha", "vs loss"}
    for path in files.plots.values():
        w, h = png_size(path)
        assert w > 200 and h > 200
        assert path.parent == grid / "report"
    assert "## Failed points" in md and "RuntimeError: boom at step 2" in md and 'File "loop.py"' in md
    assert ("val/lm_loss (lowest is best): 2.8000 at 1 (balancer.alpha=0.5, loss=topk) - one run each: not tested"
            " against the runner-up") in md
    assert "perf/tokens_per_s (machine-dependent)" in md and "perf/tokens_per_s (highest" not in md
    assert "Common overrides: trainer.max_steps=4" in md
    assert "![curves](curves.png)" in md and '<img src="vs_balancer.alpha.png"' in page
    assert page.count("<table") == 1 and "<th>val/kl_to_teacher</th>" in page
    # every finished point's row, as the hand-made summary.json has it (the best values bold)
    best = {m: min if m in ("val/lm_loss", "val/kl_to_teacher") else max for m in NAMES
            if m not in ("train/kept_mass", "perf/tokens_per_s")}
    for num, (alpha, loss) in enumerate(GRID):
        if (alpha, loss) in FINISHED:
            values = FINISHED[(alpha, loss)]
            cells = []
            for i, (metric, v) in enumerate(zip(NAMES, values)):
                cell = f"{v:.1f}" if abs(v) >= 100 else f"{v:.4f}"
                is_best = metric in best and v == best[metric](f[i] for f in FINISHED.values())
                cells.append(f"**{cell}**" if is_best else cell)
            assert f"| {num} | {alpha} | {loss} | " + " | ".join(cells) + " | 4 | finished |  |" in md, num
    assert '<tr class="failed">' in page and "RuntimeError: boom at step 2" in page
    # A second report of the same sweep finds the same points: report/ itself is never read as a run.
    assert [p.name for p in load_sweep(grid).points] == [str(i) for i in range(len(GRID))]


def test_override_and_resolved_values(tmp_path):
    root = tmp_path / "sw"
    for num, lr in enumerate(("1e-3", "2e-3")):
        config = tiny_config(0.9, "topk")
        config["trainer"].update(lr=float(lr), min_lr=0.0002 if num == 0 else "${trainer.lr}")
        # point 1 also sets min_lr to an interpolation, escaped as Hydra saves it in overrides.yaml
        overrides = [f"trainer.lr={lr}"] + (["trainer.min_lr=$\\{trainer.lr\\}"] if num == 1 else [])
        write_run_dir(root / str(num), overrides=overrides, config=config, num=num,
                      **finished_kwargs(FINISHED[(0.0, "topk")]))
    sweep = load_sweep(root)
    assert sweep.swept == ["trainer.lr", "trainer.min_lr"]
    p0, p1 = sweep.points
    assert p0.params == {"trainer.lr": 0.001, "trainer.min_lr": 0.0002}
    assert p1.params == {"trainer.lr": 0.002, "trainer.min_lr": 0.002}  # the interpolation, resolved
    assert swept_text(p0, "trainer.lr") == "1e-3"
    assert swept_text(p0, "trainer.min_lr") == "0.0002 (default)"
    assert swept_text(p1, "trainer.min_lr") == "${trainer.lr} (= 0.002)"
    assert sweep.is_numeric("trainer.lr")


def test_nested_points_and_skipped_dirs(tmp_path):
    root = tmp_path / "outer"
    for sub, alpha in (("a/0", 0.0), ("a/1", 0.5), ("b/0", 1.0)):
        d = write_run_dir(root / sub, overrides=[f"balancer.alpha={alpha}"], config=tiny_config(alpha, "topk"),
                          **finished_kwargs(FINISHED[(0.0, "topk")]))
        (d / "checkpoints" / "step_4").mkdir(parents=True)
        (d / "checkpoints" / "step_4" / "metrics.jsonl").write_text("{}\n")
    decoy = root / "report" / "old"
    decoy.mkdir(parents=True)
    (decoy / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "train/loss": 1.0}\n')
    assert [d.relative_to(root).as_posix() for d in find_run_dirs(root)] == ["a/0", "a/1", "b/0"]
    sweep = load_sweep(root)
    assert [p.name for p in sweep.points] == ["a/0", "a/1", "b/0"]
    assert [p.params["balancer.alpha"] for p in sweep.points] == [0.0, 0.5, 1.0]


def test_latest_sweep_is_the_newest(tmp_path):
    base = tmp_path / "multirun"
    # the newest by modification time, whatever the names say
    mtimes = {"2026-12-01/10-00-00-aaaaaa": 1_000_000, "2026-12-02/09-00-00-bbbbbb": 999_900,
              "2026-11-30/23-00-00-cc": 1_000_200}
    for name, mtime in mtimes.items():
        (base / name).mkdir(parents=True)
        (base / name / "sweep.json").write_text("{}")
        os.utime(base / name, (mtime, mtime))
    assert latest_sweep(base) == base / "2026-11-30/23-00-00-cc"
    with pytest.raises(FileNotFoundError, match="KDEXP_SWEEP_DIR"):
        latest_sweep(tmp_path / "nothing")


def test_single_run_dir(tmp_path):
    run = write_run_dir(tmp_path / "17-40-01-cd34ef", overrides=["loss=top_p"], config=tiny_config(0.9, "top_p"),
                        **finished_kwargs(FINISHED[(0.0, "top_p")]))
    sweep = load_sweep(run)
    assert len(sweep.points) == 1 and sweep.swept == [] and sweep.fixed == {"loss": "top_p"}
    assert sweep.points[0].name == "17-40-01-cd34ef"
    assert best_points(sweep)["val/lm_loss"].value == FINISHED[(0.0, "top_p")][0]
    out = tmp_path / "rep"
    files = write_report(sweep, out)
    assert set(files.plots) == {"curves"}
    assert png_size(out / "curves.png")[0] > 200


def test_pending_points_from_sweep_json_and_reused_curves(tmp_path):
    earlier = write_run_dir(tmp_path / "old_sweep" / "0", overrides=["balancer.alpha=0.0"],
                            config=tiny_config(0.0, "topk"), num=0, **finished_kwargs(FINISHED[(0.0, "topk")]))
    root = tmp_path / "sweep"
    reused = write_run_dir(root / "0", overrides=["balancer.alpha=0.0"], config=tiny_config(0.0, "topk"), num=0,
                           final=dict(zip(NAMES, FINISHED[(0.0, "topk")])), steps=4, reused_from=str(earlier))
    (root / "sweep.json").write_text(json.dumps({"sweep_dir": str(root), "points": [
        {"num": 0, "overrides": ["balancer.alpha=0.0"], "run_dir": str(reused), "status": "reused",
         "metrics": {}, "error": None},
        {"num": 1, "overrides": ["balancer.alpha=1.0"], "name": "balancer.alpha=1.0", "run_dir": None,
         "status": "pending", "metrics": {}, "error": None}]}))
    sweep = load_sweep(root)
    assert [p.status for p in sweep.points] == ["finished", "pending"]
    assert sweep.points[1].params == {"balancer.alpha": 1.0}
    assert sweep.points[0].curves["val/lm_loss"] == [(2, 3.2), (4, 3.0)]  # read from the earlier run
    text = dict(zip(points_table(sweep).columns, points_table(sweep).text[0]))
    assert text["status"] == "finished (reused)"


ARM_VALUES = {"before": [(3.4, 0.8), (3.2, 0.6)], "after": [(3.0, 0.4), (2.8, 0.3)], "top_p": [(3.1, 0.5), (2.9, 0.3)]}
ARM_CONFIG = {"before": ("renorm_topk", "dynamic"), "after": ("topk", "alpha"), "top_p": ("top_p", "alpha")}


def make_arms_sweep(root: Path) -> Path:
    num = 0
    for arm, runs in ARM_VALUES.items():
        for seed, (lm, kl) in zip((1, 2), runs):
            loss, balancer = ARM_CONFIG[arm]
            config = tiny_config(0.9, loss, arm=arm)
            config["balancer"]["name"] = balancer
            config["trainer"]["seed"] = seed
            final = {"val/lm_loss": lm, "val/kl_to_teacher": kl, "val/top1_agreement": 0.5, "perf/tokens_per_s": 10.0}
            write_run_dir(root / str(num), overrides=["experiment=qwen3_before_after", f"arm={arm}",
                                                      f"trainer.seed={seed}"],
                          config=config, choices={"arm": arm, "experiment": "qwen3_before_after"}, num=num,
                          final=final, steps=4, val=[{"step": 4, **final}])
            num += 1
    return root


def test_arms_side_by_side(tmp_path):
    sweep = load_sweep(make_arms_sweep(tmp_path / "arms"))
    assert sweep.arm_key == "experiment_arm" and sweep.arms == ["before", "after", "top_p"]
    assert sweep.swept == ["arm", "trainer.seed"]
    table = arms_table(sweep)
    assert table.columns == ["experiment_arm", "before", "after", "top_p"]
    rows = {r[0]: r[1:] for r in table.rows}
    assert rows["points"] == [2, 2, 2]
    assert rows["loss.name"] == ["renorm_topk", "topk", "top_p"]
    assert rows["balancer.name"] == ["dynamic", "alpha", "alpha"]
    assert "trainer.seed" not in rows  # differs within an arm, not between the arms' first points
    for metric, i in (("val/lm_loss", 0), ("val/kl_to_teacher", 1)):
        means = [sum(v[i] for v in ARM_VALUES[a]) / 2 for a in ("before", "after", "top_p")]
        assert rows[metric] == pytest.approx(means)
        text = dict(zip(table.columns, table.text[[r[0] for r in table.rows].index(metric)]))
        assert text["after"].endswith(f"({100 * (means[1] - means[0]) / means[0]:+.1f}%)")
        best_col = 1 + means.index(min(means))
        assert ([r[0] for r in table.rows].index(metric), best_col) in table.bold
    files = write_report(sweep, tmp_path / "out")
    assert "arms" in files.plots and png_size(files.plots["arms"])[0] > 200
    md = files.markdown.read_text()
    assert "## Arms (metrics: mean ± std over each arm's finished points [95% Student-t interval])" in md
    # two seeds per arm: mean ± std, the interval withheld and the table says why (t_{0.975,1} = 12.706, table value)
    lm = ARM_VALUES["before"][0][0], ARM_VALUES["before"][1][0]
    mean, sd = sum(lm) / 2, abs(lm[0] - lm[1]) / math.sqrt(2)
    cell = dict(zip(table.columns, table.text[[r[0] for r in table.rows].index("val/lm_loss")]))["before"]
    assert cell == f"{mean:.4f} ± {sd:.4f} (n=2†: no interval)"
    assert any("t(0.975, 1) = 12.7" in note for note in table.notes)
    assert "t(0.975, 1) = 12.7" in md


NAN = float("nan")
# arm -> one (val/lm_loss, val/kl_to_teacher) per finished replicate; "after" seed 2 has a NaN KL
NAN_ARMS = {"before": [(3.4, 0.8), (3.2, 0.6)], "after": [(3.0, 0.4), (2.8, NAN)]}
DIVERGED_ERROR = "diverged at step 3: non-finite train/grad_norm (train/loss=1.7, train/grad_norm=nan)"


def make_nan_sweep(root: Path) -> Path:
    """Two arms of two finished replicates (one with a NaN metric) and a diverged point whose summary holds its last
    finite metrics, val/lm_loss NaN, and whose metrics.jsonl ends on a NaN train/loss. All JSON strict, as written."""
    num = 0
    for arm, runs in NAN_ARMS.items():
        for seed, (lm, kl) in zip((1, 2), runs):
            final = {"val/lm_loss": lm, "val/kl_to_teacher": kl, "val/top1_agreement": 0.5}
            write_run_dir(root / str(num), overrides=[f"arm={arm}", f"trainer.seed={seed}"],
                          config=tiny_config(0.9, "topk", arm=arm), choices={"arm": arm}, num=num, final=final,
                          steps=4, val=[{"step": 4, **final}])
            num += 1
    write_run_dir(root / str(num), overrides=["arm=before", "trainer.seed=3"], config=tiny_config(0.9, "topk", "before"),
                  choices={"arm": "before"}, num=num, steps=4,
                  train=[{"step": 1, "train/loss": 2.5}, {"step": 2, "train/loss": 2.0}, {"step": 3, "train/loss": NAN}],
                  final={"train/loss": 2.0, "val/lm_loss": NAN, "val/kl_to_teacher": 0.7},
                  summary={"status": "diverged", "step": 3, "error": DIVERGED_ERROR, "checkpoint": 2})
    (root / str(num) / "error.log").write_text(f"Traceback (most recent call last):\n  ...\nDiverged: {DIVERGED_ERROR}\n")
    return root


def test_diverged_point_and_nan_metrics(tmp_path):
    root = make_nan_sweep(tmp_path / "nan")
    assert '"val/lm_loss": "NaN"' in (root / "4" / "summary.json").read_text()  # the fixture is strict JSON
    sweep = load_sweep(root)
    assert [p.status for p in sweep.points] == ["finished"] * 4 + ["diverged"]
    diverged = sweep.points[4]
    assert diverged.error == DIVERGED_ERROR and diverged.steps == 3
    assert diverged.final["train/loss"] == 2.0  # the summary's last finite value stands over the NaN line
    assert diverged.curves["train/loss"][:2] == [(1, 2.5), (2, 2.0)] and math.isnan(diverged.curves["train/loss"][2][1])
    table = points_table(sweep)
    text = [dict(zip(table.columns, row)) for row in table.text]
    assert text[4]["status"] == "diverged (last finite values)" and text[4]["error"] == DIVERGED_ERROR
    assert (text[4]["val/lm_loss"], text[4]["val/kl_to_teacher"], text[4]["val/top1_agreement"]) == (
        "NaN", "0.7000", "—")  # NaN is a value, "—" is missing
    assert text[3]["val/kl_to_teacher"] == "NaN" and math.isnan(table.records()[3]["val/kl_to_teacher"])
    assert text[3]["val/lm_loss"] == "2.8000"
    best = best_points(sweep)  # configurations (arm over seeds); never a NaN mean, never a diverged point
    assert best["val/lm_loss"].value == pytest.approx(2.9) and best["val/lm_loss"].ranking.best.arm == "after"
    assert best["val/kl_to_teacher"].value == pytest.approx(0.7)  # "after" has a NaN replicate: its mean is NaN
    assert best["val/kl_to_teacher"].ranking.runner_up is None

    arms = arms_table(sweep)
    rows = {r[0]: r[1:] for r in arms.rows}
    cells = {t[0]: t[1:] for t in arms.text}
    assert rows["points"] == [3, 2] and rows["finished"] == [2, 2] and rows["diverged"] == [1, 0]
    assert rows["val/lm_loss"] == pytest.approx([3.3, 2.9])  # the diverged point is not a replicate
    assert rows["val/kl_to_teacher"][0] == pytest.approx(0.7) and math.isnan(rows["val/kl_to_teacher"][1])
    assert cells["val/kl_to_teacher"][0] == "0.7000 ± 0.1414 (n=2†: no interval)"  # 2 seeds: no interval
    assert cells["val/kl_to_teacher"][1] == "NaN (1 of 2 non-finite)"  # propagated, with the count
    assert [c.split(" ± ")[0] for c in cells["val/lm_loss"]] == ["3.3000", "2.9000"]
    assert cells["val/lm_loss"][1].endswith(f"({100 * (2.9 - 3.3) / 3.3:+.1f}%)")

    files = write_report(sweep, tmp_path / "out")
    md, page = files.markdown.read_text(), files.html.read_text()
    assert "5 points: 4 finished, 1 diverged" in md and "## Diverged points" in md
    assert f"`{DIVERGED_ERROR}`" in md and f"Diverged: {DIVERGED_ERROR}" in md  # the error and its error.log
    assert "| 4 | before | 3 | NaN | 0.7000 | — |" in md
    assert '<tr class="diverged">' in page and "<td>NaN (1 of 2 non-finite)</td>" in page
    r = run_cli(str(root))
    assert r.returncode == 0, r.stderr
    assert f"diverged 4: {DIVERGED_ERROR}" in r.stdout


# ---------------------------------------------------------------------------------------------------------------------
class FakeRun:
    def __init__(self, name, state, config, summary, history):
        self.name, self.state, self.config, self.summary, self._history = name, state, config, summary, history
        self.id = name

    def history(self, samples=500, pandas=True):
        import pandas as pd

        return pd.DataFrame.from_records(self._history)


class FakeApi:
    calls: list = []

    def __init__(self, runs):
        self._runs = runs

    def runs(self, path, filters=None):
        FakeApi.calls.append((path, filters))
        return iter(self._runs)


def fake_runs(named_by_overrides: bool) -> list[FakeRun]:
    runs = []
    for alpha, loss in [(0.0, "topk"), (1.0, "topk"), (1.0, "top_p")]:
        lm, kl, ag, km, tps = FINISHED.get((alpha, loss), (2.5, 0.25, 0.65, 0.97, 800.0))
        config = tiny_config(alpha, loss)
        config["trainer"]["min_lr"] = 0.002
        history = [{"_step": 1, "train/loss": lm + 1, "perf/tokens_per_s": tps, "_runtime": 1.0},
                   {"_step": 2, "train/loss": lm + 0.5, "val/lm_loss": lm + 0.2},
                   {"_step": 4, "train/loss": lm + 0.1, "train/kept_mass": km, "val/lm_loss": lm,
                    "val/kl_to_teacher": kl, "val/top1_agreement": ag}]
        summary = {"val/lm_loss": lm, "val/kl_to_teacher": kl, "val/top1_agreement": ag, "train/kept_mass": km,
                   "perf/tokens_per_s": tps, "_step": 4, "_wandb": {"runtime": 3}}
        name = f"balancer.alpha={alpha},loss={loss}" if named_by_overrides else f"fox-{len(runs)}"
        state = "crashed" if (alpha, loss) == (1.0, "top_p") else "finished"
        runs.append(FakeRun(name, state, config, summary, history))
    return runs


def test_wandb_group_through_cli_with_fake_api(tmp_path, monkeypatch):
    import wandb

    FakeApi.calls = []
    runs = fake_runs(named_by_overrides=True)
    monkeypatch.setattr(wandb, "Api", lambda *a, **k: FakeApi(runs))
    out = tmp_path / "wb"
    assert report_main(["--wandb-group", "2026-12-02_17-34-40-ab12cd", "--wandb-project", "p",
                        "--wandb-entity", "e", "--out", str(out)]) == 0
    assert FakeApi.calls == [("e/p", {"group": "2026-12-02_17-34-40-ab12cd"})]
    md = (out / "report.md").read_text()
    assert "# kdexp report: wandb:e/p/2026-12-02_17-34-40-ab12cd" in md
    assert "| balancer.alpha=0.0,loss=topk | 0.0 | topk | 3.0000 | 0.5000 | 0.4000 | 0.9000 | 1000.0 |" in md
    assert "W&B run state: crashed" in md
    assert png_size(out / "curves.png")[0] > 200


def test_wandb_adapter_records(monkeypatch):
    sweep = load_wandb_group("g", project="p", api=FakeApi(fake_runs(named_by_overrides=True)))
    assert sweep.swept == ["balancer.alpha", "loss"]
    p = sweep.points[0]
    assert p.params == {"balancer.alpha": 0.0, "loss": "topk"}
    assert p.curves["val/lm_loss"] == [(2, 3.2), (4, 3.0)]  # NaN cells of the history are not points
    assert p.curves["train/loss"] == [(1, 4.0), (2, 3.5), (4, pytest.approx(3.1))]
    assert "_runtime" not in p.curves and "_wandb" not in p.final
    assert p.final["val/lm_loss"] == 3.0 and p.steps == 4 and p.status == "finished"
    assert [q.status for q in sweep.points] == ["finished", "finished", "failed"]
    assert best_points(sweep)["val/lm_loss"].point is sweep.points[1]  # 2.9; the crashed run (2.5) is not a pick
    # Runs not named by overrides: the swept keys come from the configs that differ.
    sweep = load_wandb_group("g", project="p", api=FakeApi(fake_runs(named_by_overrides=False)))
    assert sweep.swept == ["loss.name", "balancer.alpha"]
    assert sweep.aliases == {"loss.name": ["loss.top_p"]}  # top_p is set by the loss choice: one parameter
    assert [q.params["balancer.alpha"] for q in sweep.points] == [0.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kdexp.report", *args], capture_output=True, text=True, cwd=REPO)


def test_cli_exit_codes(grid, tmp_path):
    r = run_cli(str(grid))
    assert r.returncode == 0, r.stderr
    assert f"report: {grid / 'report' / 'report.md'}" in r.stdout
    assert "failed 4: RuntimeError: boom at step 2" in r.stdout
    assert "<table" in (grid / "report" / "index.html").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli(str(empty))
    assert r.returncode == 1 and "no runs found" in r.stderr
    r = run_cli(str(tmp_path / "missing"))
    assert r.returncode == 2 and "sweep_dir=" in r.stderr
    r = run_cli("--wandb-group", "g")
    assert r.returncode == 2 and "--out" in r.stderr


def test_report_never_imports_training_code():
    code = ("import sys, kdexp.report, kdexp.report.__main__\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'wandb') or "
            "m.startswith(('kdexp.train', 'kdexp.models', 'kdexp.losses', 'kdexp.distributed', 'kdexp.data'))]\n"
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_metrics_jsonl_tolerates_a_cut_line(tmp_path):
    run = write_run_dir(tmp_path / "r", overrides=[], config=tiny_config(0.9, "topk"),
                        train=[{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.5}])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "kind": "train", "train/lo')  # a kill in the middle of a write
    p = load_sweep(run).points[0]
    assert p.status == "running" and p.curves["train/loss"] == [(1, 2.0), (2, 1.5)]
    assert not math.isnan(p.final["train/loss"])


# ---------------------------------------------------------------------------------------------------------------------
# A real tiny sweep (python -m kdexp.run -m ..., shared with tests/test_notebook.py through tests/sweeps.py)
@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory, seeded_cache):
    from sweeps import checked_real_points, real_tiny_sweep

    sweep_dir, proc = real_tiny_sweep(tmp_path_factory, seeded_cache)
    points = checked_real_points(sweep_dir, proc)
    return sweep_dir, points


@pytest.mark.slow
def test_report_on_real_sweep(real_sweep):
    sweep_dir, expected = real_sweep
    sweep = load_sweep(sweep_dir)
    assert "balancer.alpha" in sweep.swept
    by_alpha = {p.params["balancer.alpha"]: p for p in sweep.points}
    assert sorted(by_alpha) == [0.0, 1.0]  # alpha=1.5 was refused before it claimed a run dir: never counted
    table = points_table(sweep)
    rows = {r["balancer.alpha"]: r for r in table.records()}
    for alpha in (0.0, 1.0):
        assert rows[alpha]["status"] == "finished"
        for metric in NAMES:  # the table shows summary.json's final values
            assert rows[alpha][metric] == expected[alpha]["final"][metric], (alpha, metric)
        assert by_alpha[alpha].curves["train/loss"][-1][1] == expected[alpha]["last"]["train/loss"]
    assert expected[1.5]["status"] == "refused" and "balancer.alpha=1.5 is invalid" in expected[1.5]["error"]
    assert 1.5 not in rows
    best = best_points(sweep)
    lm = {a: expected[a]["final"]["val/lm_loss"] for a in (0.0, 1.0)}
    assert best["val/lm_loss"].point is by_alpha[min(lm, key=lm.get)]
    r = run_cli(str(sweep_dir))
    assert r.returncode == 0, r.stderr
    for name in ("report.md", "index.html", "curves.png", "vs_balancer.alpha.png"):
        assert (sweep_dir / "report" / name).is_file(), name
    png_size(sweep_dir / "report" / "vs_balancer.alpha.png")
