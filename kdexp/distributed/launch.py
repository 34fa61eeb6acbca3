"""Who this process is, from the launcher's environment: global rank, local rank, world size, rendezvous address.

The one reading of the launcher variables (torchrun, submitit, plain SLURM srun, a lone process). Stdlib only and
cheap: kdexp.track (which writes files on global rank 0 only) asks it before any process group exists, in processes
that never import torch; kdexp.distributed.initialize uses the same answer to create the process group.
"""
from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["Launch", "launch_env", "global_rank", "local_rank", "world_size", "first_slurm_host"]


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: Optional[int]  # None = a lone process picks a free one
    source: str  # torchrun | submitit | slurm | local


def first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM nodelist such as 'gpu[03-05,9],cpu1' -> 'gpu03' (no scontrol needed)."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"SLURM_JOB_NODELIST: cannot parse {nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_env(env: Optional[Mapping[str, str]] = None) -> Launch:
    """This process's place in its job, from ``env`` (default os.environ), first match wins:

    - torchrun (or anything that exports RANK and WORLD_SIZE): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT;
    - submitit (SUBMITIT_EXECUTOR, SLURM or local): submitit's JobEnvironment; the port derived from the job id;
    - plain SLURM, only inside an srun step (in the batch script itself SLURM_NTASKS counts tasks that do not run):
      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of the nodelist, a port derived from the job id;
    - otherwise one local process.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                      env.get("MASTER_ADDR", "127.0.0.1"),
                      int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None, "torchrun")
    if env.get("SUBMITIT_EXECUTOR"):
        if env is not os.environ:
            raise ValueError("launch_env: a submitit job is read from os.environ (submitit's JobEnvironment)")
        from submitit.helpers import TorchDistributedEnvironment  # no torch inside; submitit runs this job

        te = TorchDistributedEnvironment()
        return Launch(te.rank, te.world_size, te.local_rank, te.master_addr, te.master_port, "submitit")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        world = int(env["SLURM_NTASKS"])
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None
        if port is None and world > 1:
            # Every task must agree on the port without talking: derive it from the job id (as submitit does).
            port = random.Random(env.get("SLURM_JOB_ID", "0")).randint(20000, 60000)
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return Launch(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", "0")), addr, port, "slurm")
    return Launch(0, 1, 0, "127.0.0.1", None, "local")


def global_rank() -> int:
    """0 on the one process that writes files and talks to W&B."""
    return launch_env().rank


def local_rank() -> int:
    return launch_env().local_rank


def world_size() -> int:
    return launch_env().world_size
