"""One test process on its own: no launcher variables, kdexp.distributed torn down before and after.

A test started inside torchrun/SLURM/submitit (or after a test that left a process group) would otherwise take the
launcher's path in kdexp.distributed.initialize. ``lone_process`` removes the variables the launch lookup reads,
destroys any earlier state, initializes when a seed is given, and destroys again on exit. Pass the test's
``monkeypatch`` when the test sets launcher variables itself, so that both undo in one stack (last set, first undone).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import pytest
import torch

import kdexp.distributed as kd

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_LOCALID",
               "SLURM_JOB_NODELIST", "SLURM_JOB_ID")


def _destroy() -> None:
    if kd.is_initialized() or torch.distributed.is_initialized():
        kd.destroy()


@contextmanager
def lone_process(seed: Optional[int] = None, monkeypatch: Optional[pytest.MonkeyPatch] = None):
    """Yields kdexp.distributed.initialize(seed=seed)'s state, or None without a seed."""
    with pytest.MonkeyPatch.context() as own:
        mp = monkeypatch if monkeypatch is not None else own
        for var in LAUNCH_VARS:
            mp.delenv(var, raising=False)
        _destroy()
        try:
            yield None if seed is None else kd.initialize(seed=seed)
        finally:
            _destroy()
