"""Throwaway Hydra apps for the sweep and SLURM tests: a config that uses kdexp's launcher presets, the kdexp_uid
resolver and the sweep callback (kdexp.report.callback.LiveSweepCallback), written into a test's tmp_path together with a task function the test chooses."""
from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path
from typing import Optional

import kdexp.conf
from _launch import kdexp_run

CONF_DIR = Path(kdexp.conf.__file__).resolve().parent

APP_CONFIG = f"""\
x: 1
hydra:
  searchpath:
    - file://{CONF_DIR}
    - ${{kdexp_site_dir:}}
  job:
    chdir: false
  sweep:
    dir: ${{oc.env:SWEEP_ROOT}}/${{now:%Y-%m-%d}}/${{kdexp_uid:}}
    subdir: ${{hydra.job.num}}
  callbacks:
    sweep:
      _target_: kdexp.report.callback.LiveSweepCallback
"""

APP_HEADER = """\
import os
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

import kdexp.track.sweep  # noqa: F401  (kdexp_uid, kdexp_site_dir resolvers)

"""

APP_FOOTER = """

@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg):
    return task(cfg)


if __name__ == "__main__":
    main()
"""


def write_app(root: Path, task_source: str, name: str = "app") -> Path:
    """root/<name>.py with ``def task(cfg)`` from task_source, and root/config.yaml. Returns the script path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(APP_CONFIG)
    script = root / f"{name}.py"
    script.write_text(APP_HEADER + task_source + APP_FOOTER)
    return script


def app_env(sweep_root: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("KDEXP_SITE_DIR", None)  # a developer's site file must not change what the tests launch
    env["XDG_CONFIG_HOME"] = str(sweep_root / "xdg-empty")
    env.update(SWEEP_ROOT=str(sweep_root), PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", **extra)
    return env


def run_app(script: Path, args: list[str], sweep_root: Path, timeout: float = 300,
            env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``python SCRIPT -m ARGS`` to its end (tests/_launch.py's kdexp_run: its workers, SLURM tasks included, are
    forked from the fork server); past ``timeout`` it is killed and raises AssertionError with its output."""
    return kdexp_run(["-m", *args], env or app_env(sweep_root), script.parent, entry=str(script), check=False,
                     timeout=timeout)


def sweep_dirs(sweep_root: Path) -> list[Path]:
    return sorted(Path(p).parent for p in glob.glob(str(sweep_root / "*" / "*" / "sweep.json")))


def load_sweep(sweep_root: Path) -> dict:
    (d,) = sweep_dirs(sweep_root)
    return json.loads((d / "sweep.json").read_text())
