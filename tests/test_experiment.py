"""experiment=qwen3_before_after runs its four arms x seeds on the embedded default on the local submitit launcher
(each point its own process), and the report puts the arms side by side, over seeds, paired by seed."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from kdexp.report import arms_table, configurations_table, differences_table, load_sweep
from sweeps import REPO
from _launch import kdexp_run

ARM_NAMES = ("before", "after", "top_p", "sampled")


def test_preset_sweeps_three_seeds():
    params = yaml.safe_load((REPO / "conf" / "experiment" / "qwen3_before_after.yaml").read_text())["hydra"]["sweeper"][
        "params"]
    assert str(params["trainer.seed"]).split(",") == ["1", "2", "3"]

pytestmark = pytest.mark.slow


def test_before_after_arms_run_and_report(env, tmp_path):
    sweep_dir = tmp_path / "before_after"
    # 2 seeds instead of the preset's 3 (a command-line sweep of trainer.seed replaces it), on local_cpu
    proc = kdexp_run(["experiment=[qwen3_before_after,smoke]", "trainer.max_steps=2", "trainer.eval_interval=2",
                      "trainer.seed=1,2", "hydra/launcher=local_cpu", "logger=none", f"hydra.sweep.dir={sweep_dir}"],
                     env, tmp_path)
    assert "8 points" in proc.stdout + proc.stderr  # the experiment itself switches Hydra to MULTIRUN
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["status"] for p in sweep["points"]] == ["finished"] * 8
    assert (sweep_dir / ".submitit").is_dir()  # each point ran in a submitit worker
    # ... and took one of the local slots (kdexp.track.slots) before it trained: 1 on this 2-core box
    logs = [p.read_text() for p in (sweep_dir / ".submitit").glob("*/*_log.out")]
    assert len(logs) == 8 and all("local slot " in text for text in logs)
    arms, seeds = {}, {}
    for num in range(8):
        cfg = yaml.safe_load((sweep_dir / str(num) / ".hydra" / "config.yaml").read_text())
        arms[cfg["experiment_arm"]] = cfg
        seeds.setdefault(cfg["experiment_arm"], []).append(cfg["trainer"]["seed"])
    assert seeds == {a: [1, 2] for a in ARM_NAMES}
    assert set(arms) == set(ARM_NAMES)
    before, after, top_p, sampled = arms["before"], arms["after"], arms["top_p"], arms["sampled"]
    assert (before["loss"]["normalization"], before["loss"]["ghost_token"]) == ("renormalize", False)
    assert (before["balancer"]["name"], before["balancer"]["skip_lm_loss"]) == ("dynamic", True)
    assert (after["loss"]["normalization"], after["loss"]["ghost_token"], after["loss"]["top_k"]) == ("full", True,
                                                                                                    1024)
    assert (after["balancer"]["name"], after["balancer"]["alpha"]) == ("alpha", 0.9)
    assert top_p["loss"]["top_p"] == 0.95 and top_p["loss"]["ghost_token"]
    assert (sampled["loss"]["samples"], sampled["loss"]["top_k"], sampled["loss"]["ghost_token"]) == (64, None, False)
    assert (sampled["balancer"]["name"], sampled["balancer"]["alpha"]) == ("alpha", 0.9)
    report = subprocess.run([sys.executable, "-m", "kdexp.report", str(sweep_dir)], capture_output=True, text=True,
                            timeout=300)
    assert report.returncode == 0, report.stderr
    # The arms table holds each arm's mean over its two seeds from their summary.json files, and report.md prints
    # exactly those; the configurations and paired differences pair the arms by seed.
    finals: dict = {}
    for num in range(8):
        summary = json.loads((sweep_dir / str(num) / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["steps"] == 2
        cfg = yaml.safe_load((sweep_dir / str(num) / ".hydra" / "config.yaml").read_text())
        finals.setdefault(cfg["experiment_arm"], {})[cfg["trainer"]["seed"]] = summary["final"]
    loaded = load_sweep(sweep_dir)
    assert loaded.seed_key == "trainer.seed"
    configs = configurations_table(loaded)
    assert [r[0] for r in configs.rows] == [f"arm={a}" for a in ARM_NAMES]
    assert configs.column("n") == [2] * 4 and configs.column("seeds") == [[1, 2]] * 4
    for r, arm in enumerate(ARM_NAMES):
        s = configs.column("val/kl_to_teacher")[r]
        values = [finals[arm][seed]["val/kl_to_teacher"] for seed in (1, 2)]
        assert s.mean == pytest.approx(sum(values) / 2, rel=1e-12)
        assert s.std == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2), rel=1e-9, abs=1e-15)
    diffs = differences_table(loaded)
    kl = {r[1]: r for r in diffs.rows if r[0] == "val/kl_to_teacher"}
    assert set(kl) == {"arm=after", "arm=top_p", "arm=sampled"} and all(r[2] == "arm=before" for r in kl.values())
    for arm in ("after", "top_p", "sampled"):
        d = [finals[arm][seed]["val/kl_to_teacher"] - finals["before"][seed]["val/kl_to_teacher"] for seed in (1, 2)]
        assert kl[f"arm={arm}"][3] == pytest.approx(sum(d) / 2, rel=1e-9)
        assert kl[f"arm={arm}"][5] == "paired by seed (n=2)"
    table = arms_table(loaded)
    order = table.columns[1:]
    assert table.columns[0] == "experiment_arm" and sorted(order) == ["after", "before", "sampled", "top_p"]
    rows = {r[0]: r[1:] for r in table.rows}
    cells = {t[0]: t[1:] for t in table.text}
    assert rows["points"] == rows["finished"] == [2, 2, 2, 2]
    assert rows["loss.normalization"] == [arms[a]["loss"]["normalization"] for a in order]
    text = (sweep_dir / "report" / "report.md").read_text()
    for metric in ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/kept_mass"):
        expected = [sum(finals[a][seed][metric] for seed in (1, 2)) / 2 for a in order]
        assert rows[metric] == pytest.approx(expected, rel=1e-12), metric
        assert all(math.isfinite(v) for v in expected), metric
        assert cells[metric][0].startswith(f"{expected[0]:.4f} ± ")
        assert f"| {metric} | " + " | ".join(
            c if (list(rows).index(metric), i + 1) not in table.bold else f"**{c}**" for i, c in enumerate(cells[metric])
        ) + " |" in text, metric
