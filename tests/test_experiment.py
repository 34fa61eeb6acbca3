"""experiment=qwen3_before_after runs its four arms on the embedded default and the report puts them side by side."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from kdexp.report import arms_table, load_sweep
from test_train import env, kdexp_run  # noqa: F401  (module fixture: a private KDEXP_CACHE)

pytestmark = pytest.mark.slow


def test_before_after_arms_run_and_report(env, tmp_path):  # noqa: F811
    sweep_dir = tmp_path / "before_after"
    proc = kdexp_run(["experiment=[qwen3_before_after,smoke]", "trainer.max_steps=2", "trainer.eval_interval=2",
                      "logger=none", f"hydra.sweep.dir={sweep_dir}"], env, tmp_path)
    assert "4 points" in proc.stdout + proc.stderr  # the experiment itself switches Hydra to MULTIRUN
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["status"] for p in sweep["points"]] == ["finished"] * 4
    arms = {}
    for num in range(4):
        cfg = yaml.safe_load((sweep_dir / str(num) / ".hydra" / "config.yaml").read_text())
        arms[cfg["experiment_arm"]] = cfg
    assert set(arms) == {"before", "after", "top_p", "sampled"}
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
    # The arms table holds each arm's numbers from its summary.json (one point per arm: the mean is that value),
    # and report.md prints exactly those.
    finals = {}
    for num in range(4):
        summary = json.loads((sweep_dir / str(num) / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["steps"] == 2
        finals[yaml.safe_load((sweep_dir / str(num) / ".hydra" / "config.yaml").read_text())["experiment_arm"]] = \
            summary["final"]
    table = arms_table(load_sweep(sweep_dir))
    order = table.columns[1:]
    assert table.columns[0] == "experiment_arm" and sorted(order) == ["after", "before", "sampled", "top_p"]
    rows = {r[0]: r[1:] for r in table.rows}
    cells = {t[0]: t[1:] for t in table.text}
    assert rows["points"] == rows["finished"] == [1, 1, 1, 1]
    assert rows["loss.normalization"] == [arms[a]["loss"]["normalization"] for a in order]
    text = (sweep_dir / "report" / "report.md").read_text()
    for metric in ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/kept_mass"):
        expected = [finals[a][metric] for a in order]
        assert rows[metric] == expected, metric
        assert all(math.isfinite(v) for v in expected), metric
        assert cells[metric][0] == f"{expected[0]:.4f}"
        assert f"| {metric} | " + " | ".join(
            c if (list(rows).index(metric), i + 1) not in table.bold else f"**{c}**" for i, c in enumerate(cells[metric])
        ) + " |" in text, metric
