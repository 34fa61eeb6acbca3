"""The one-node SLURM cluster for tests/test_slurm.py: use it when it runs, start it when this process can, and
otherwise skip the SLURM tests with the reason (a failure under CI=true, so CI never silently drops them).

Starting means running the idempotent ``python -m kdexp.launchers start-slurm`` (launchers/start_slurm.sh:
installs slurm-wlm + munge with apt-get if missing, writes /etc/slurm/slurm.conf, starts munged, slurmctld and
slurmd). It needs root and, when SLURM is not installed yet, apt-get. Parallel pytest processes (xdist workers,
two sessions) serialize on a file lock; the second one finds the cluster up and returns at once.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest

START = "python -m kdexp.launchers start-slurm"  # = bash launchers/start_slurm.sh
START_CMD = [sys.executable, "-m", "kdexp.launchers", "start-slurm"]
LOCK = Path(tempfile.gettempdir()) / "kdexp-start-slurm.lock"
USABLE = {"idle", "mixed", "allocated", "completing"}


def under_ci(env=os.environ) -> bool:
    return env.get("CI", "").strip().lower() in ("1", "true", "yes")


def cluster_problem() -> Optional[str]:
    """None when sinfo shows a node jobs can start on; else what is wrong."""
    if shutil.which("sinfo") is None:
        return "SLURM is not installed (no sinfo on PATH)"
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "SLURM does not answer (sinfo timed out after 60 s)"
    states = {s.strip().rstrip("*~#$@+") for s in r.stdout.split()}
    if r.returncode != 0 or not states & USABLE:
        return f"SLURM is not running (sinfo rc={r.returncode}, node states {sorted(states)}, {r.stderr.strip()!r})"
    return None


def cannot_start() -> Optional[str]:
    """None when this process may run the start script; else why not."""
    if os.geteuid() != 0:
        return "starting it needs root"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "SLURM is not installed and there is no apt-get to install it"
    return None


def start(timeout: float = 900.0) -> Optional[str]:
    """Run the start script under the lock. None on success, else the script's exit status and stderr tail."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if cluster_problem() is None:  # another process started it while we waited
            return None
        try:
            r = subprocess.run(START_CMD, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"`{START}` did not finish in {timeout:.0f} s"
    if r.returncode != 0:
        return f"`{START}` exited {r.returncode}: {r.stderr.strip()[-1500:]}"
    return cluster_problem()


def ensure() -> Optional[str]:
    """None when the cluster is usable (starting it if needed and possible); else the reason it is not."""
    problem = cluster_problem()
    if problem is None:
        return None
    why_not = cannot_start()
    if why_not is not None:
        return f"{problem}; {why_not}: run `sudo bash launchers/start_slurm.sh` first"
    failed = start()
    return None if failed is None else f"{problem}; starting it failed: {failed}"


def skip_or_fail(reason: str, env=os.environ) -> None:
    """Skip with the reason, or fail under CI=true (CI must run the SLURM tests)."""
    if under_ci(env):
        pytest.fail(f"CI=true and the SLURM cluster is not usable: {reason}", pytrace=False)
    pytest.skip(f"SLURM tests: {reason}")
