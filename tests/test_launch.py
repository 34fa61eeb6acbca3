"""kdexp.distributed.launch: who this process is, from the launcher's variables (given as a mapping: no process)."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kdexp.distributed.launch import Launch, first_slurm_host, launch_env


@pytest.mark.parametrize("env, expected", [
    ({}, Launch(0, 1, 0, "127.0.0.1", None, "local")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"},
     Launch(3, 8, 1, "n1", 29500, "torchrun")),
    # torchrun's variables win over SLURM's (torchrun started inside an allocation)
    ({"RANK": "2", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"},
     Launch(2, 4, 0, "127.0.0.1", None, "torchrun")),
    # an srun step: the port every task derives from the job id, the first host of the nodelist
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77",
      "SLURM_JOB_NODELIST": "gpu[03-05,9]"},
     Launch(5, 8, 1, "gpu03", random.Random("77").randint(20000, 60000), "slurm")),
    # the batch script itself (no step): one process, whatever SLURM_NTASKS says
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "77"}, Launch(0, 1, 0, "127.0.0.1", None, "local")),
    # RANK alone is not a launch (torchrun always sets WORLD_SIZE too)
    ({"RANK": "1"}, Launch(0, 1, 0, "127.0.0.1", None, "local")),
])
def test_launch_env(env, expected):
    assert launch_env(env) == expected


def test_first_slurm_host():
    assert first_slurm_host("gpu[03-05,9],cpu1") == "gpu03"
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("a[1,4]") == "a1"


def test_submitit_is_read_from_the_process_environment_only():
    with pytest.raises(ValueError, match="os.environ"):
        launch_env({"SUBMITIT_EXECUTOR": "local"})


def test_rank_lookup_and_sweep_bookkeeping_import_no_torch():
    # kdexp.track asks for the rank in processes that never train (the sweep's submitting process, run.py before the
    # config is known good): importing it must not pay for torch or megatron
    code = ("import sys, kdexp.distributed.launch, kdexp.track.sweep, kdexp.track.points, kdexp.conf\n"
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
