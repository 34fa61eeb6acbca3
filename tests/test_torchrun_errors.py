"""A user error under a real 2-process torchrun (gloo, CPU): every rank exits 2 before building anything, kdexp's one
line is printed once (rank 0), and torchrun's failure summary names that line as each rank's root cause (through
the rank's TORCHELASTIC_ERROR_FILE) with exit code 2. torchrun itself ends with its own ChildFailedError traceback
and status 1 whatever its workers' status: that part is torchrun's (docs/running.md says so and how to check a config
first); srun and the SLURM launchers pass the ranks' status 2 on."""
from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

LINE = "kdexp: error: trainer.lr=-1.0 is invalid: must be a finite number > 0"


def test_a_bad_value_under_torchrun_is_one_line_and_exit_2_on_every_rank(env, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(port), "-m", "kdexp.run", "trainer.lr=-1",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert [x for x in out.splitlines() if x.startswith("kdexp:")] == [LINE]  # once: rank 0 speaks
    # torchrun's summary: both ranks exited 2; the root cause is kdexp's line (no Python traceback of ours)
    assert re.findall(r"exitcode\s*:\s*(\d+)", out) == ["2", "2"]
    root = out.split("Root Cause")[-1]
    assert f"traceback : {LINE}" in root and "kdexp/" not in out.split("ChildFailedError")[0]
    assert r.returncode == 1  # torchrun's own status for any failed worker (documented)
    cache = tmp_path / "cache"
    assert not (tmp_path / "run" / "checkpoints").exists() and not (cache.exists() and any(cache.iterdir()))
