"""experiment=qwen3_before_after runs its three arms on the embedded default and the report puts them side by side."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from test_train import env, kdexp_run  # noqa: F401  (module fixture: a private KDEXP_CACHE)

pytestmark = pytest.mark.slow


def test_before_after_arms_run_and_report(env, tmp_path):  # noqa: F811
    sweep_dir = tmp_path / "before_after"
    proc = kdexp_run(["experiment=[qwen3_before_after,smoke]", "trainer.max_steps=2", "trainer.eval_interval=2",
                      "logger=none", f"hydra.sweep.dir={sweep_dir}"], env, tmp_path)
    assert "3 points" in proc.stdout + proc.stderr  # the experiment itself switches Hydra to MULTIRUN
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["status"] for p in sweep["points"]] == ["finished"] * 3
    arms = {}
    for num in range(3):
        cfg = yaml.safe_load((sweep_dir / str(num) / ".hydra" / "config.yaml").read_text())
        arms[cfg["experiment_arm"]] = cfg
    assert set(arms) == {"before", "after", "top_p"}
    before, after, top_p = arms["before"], arms["after"], arms["top_p"]
    assert (before["loss"]["normalization"], before["loss"]["ghost_token"]) == ("renormalize", False)
    assert (before["balancer"]["name"], before["balancer"]["skip_lm_loss"]) == ("dynamic", True)
    assert (after["loss"]["normalization"], after["loss"]["ghost_token"], after["loss"]["top_k"]) == ("full", True,
                                                                                                    1024)
    assert (after["balancer"]["name"], after["balancer"]["alpha"]) == ("alpha", 0.9)
    assert top_p["loss"]["top_p"] == 0.95 and top_p["loss"]["ghost_token"]
    report = subprocess.run([sys.executable, "-m", "kdexp.report", str(sweep_dir)], capture_output=True, text=True,
                            timeout=300)
    assert report.returncode == 0, report.stderr
    text = (sweep_dir / "report" / "report.md").read_text()
    assert "## Arms" in text and all(arm in text for arm in ("before", "after", "top_p"))
