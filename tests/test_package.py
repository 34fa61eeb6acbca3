"""The wheel carries the Hydra config and launchers; an installed kdexp runs from any directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from _launch import kdexp_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    (whl,) = out.glob("kdexp-*.whl")
    return whl


def test_wheel_contains_config_groups_and_launchers(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("kdexp/conf/config.yaml", "kdexp/conf/loss/topk.yaml", "kdexp/conf/loss/top_p.yaml",
                     "kdexp/conf/loss/dense.yaml", "kdexp/conf/loss/renorm_topk.yaml",
                     "kdexp/conf/balancer/alpha.yaml", "kdexp/conf/balancer/dynamic.yaml",
                     "kdexp/conf/model/qwen3.yaml", "kdexp/conf/model/qwen3_tiny.yaml",
                     "kdexp/conf/data/stdlib.yaml", "kdexp/conf/data/indexed.yaml",
                     "kdexp/conf/experiment/qwen3_before_after.yaml", "kdexp/conf/experiment/smoke.yaml",
                     "kdexp/conf/hydra/launcher/slurm_gpu.yaml", "kdexp/conf/hydra/launcher/slurm_cpu.yaml",
                     "kdexp/conf/hydra/launcher/local_cpu.yaml", "kdexp/launchers/start_slurm.sh",
                     "kdexp/launchers/stop_slurm.sh", "kdexp/launchers/site.yaml.example", "kdexp/bench/gpu.py"):
        assert required in names, required
    # every package of the source tree ships (pyproject lists them: conf/ and launchers/ are mapped into kdexp/)
    packages = {str(d.relative_to(ROOT)) for d in (ROOT / "kdexp").rglob("__init__.py")}
    packages |= {"conf/__init__.py", "launchers/__init__.py"}
    for init in packages:
        in_wheel = init if init.startswith("kdexp/") else f"kdexp/{init}"
        assert in_wheel in names, f"{init} is not in the wheel: add its package to pyproject's [tool.setuptools]"
    assert not any(n.startswith(("conf/", "launchers/", "tests/")) for n in names)  # nothing outside the package


def test_wheel_carries_the_apache_license(wheel):
    z = zipfile.ZipFile(wheel)
    (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    assert "License-Expression: Apache-2.0" in z.read(metadata).decode().splitlines()
    (license_file,) = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    text = z.read(license_file).decode()
    assert text == (ROOT / "LICENSE").read_text() and "Apache License" in text and "Version 2.0, January 2004" in text


@pytest.mark.slow
def test_installed_package_runs_from_another_directory(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "KDEXP_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"}
    env.pop("KDEXP_RUN_STAMP", None)
    where = subprocess.run([sys.executable, "-c", "import kdexp; print(kdexp.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target)), where  # the installed copy, not the source tree
    proc = kdexp_run(["experiment=smoke", "trainer.max_steps=2", "trainer.eval_interval=2", "logger=none",
                      "hydra.run.dir=run"], env, elsewhere, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((elsewhere / "run" / "summary.json").read_text())["status"] == "finished"
