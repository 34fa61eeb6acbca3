"""Checkpoint / resume of the student: model shard, optimizer, step, data position, RNG, interval accumulators.

Layout: ``checkpoints/step_<N>/tp<r>.pt`` (one file per TP rank; data-parallel replicas are identical, so only DP
rank 0 writes) and ``checkpoints/latest`` holding N. A step directory is complete before ``latest`` points at it:
every TP rank writes ``tp<r>.pt`` through a temp file + os.replace, a barrier, then global rank 0 replaces ``latest``.
A run killed at any moment therefore resumes from the last complete step.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from kdexp import distributed
from kdexp.data.cache import barrier


def latest_step(ckpt_dir: Path) -> Optional[int]:
    try:
        return int((Path(ckpt_dir) / "latest").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def save(ckpt_dir: Path, step: int, state: dict[str, Any], *, keep: int = 2) -> None:
    st = distributed.state()
    ckpt_dir = Path(ckpt_dir)
    step_dir = ckpt_dir / f"step_{step}"
    if st.dp_rank == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
        tmp = step_dir / f".tp{st.tp_rank}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, step_dir / f"tp{st.tp_rank}.pt")
    barrier()
    if st.rank == 0:
        tmp = ckpt_dir / ".latest.tmp"
        tmp.write_text(f"{step}\n")
        os.replace(tmp, ckpt_dir / "latest")
        steps = sorted(int(p.name[5:]) for p in ckpt_dir.glob("step_*") if p.name[5:].isdigit())
        for old in steps[:-keep]:
            shutil.rmtree(ckpt_dir / f"step_{old}", ignore_errors=True)
    barrier()


def load(ckpt_dir: Path) -> Optional[dict[str, Any]]:
    """This TP rank's state at the latest complete step, or None when there is none."""
    step = latest_step(ckpt_dir)
    if step is None:
        return None
    path = Path(ckpt_dir) / f"step_{step}" / f"tp{distributed.state().tp_rank}.pt"
    # on the CPU: torch.set_rng_state takes a CPU tensor and AdamW's `step` counters must stay on the host;
    # load_state_dict moves weights and moments to the model's device
    return torch.load(path, map_location="cpu", weights_only=False)
