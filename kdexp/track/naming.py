"""W&B names of a run: one group per sweep, a point named by its swept overrides, job type sweep or run.

Pure functions of the Hydra config (and of sweep.json, which names what is swept), so the names are the same in the
submitting process, on every SLURM task and in a report that reads the group back.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from kdexp.track import records
from kdexp.track.hydra_adapter import hydra_node, is_multirun


def _kept(override: str) -> bool:
    return not records.is_hydra_key(records.override_key(override))


def sweep_keys(points_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Keys whose value differs between the points of a sweep (in first-seen order); hydra keys excluded."""
    values: dict[str, set] = {}
    for overrides in points_overrides:
        for o in filter(_kept, overrides):
            values.setdefault(records.override_key(o), set()).add(o)
    n = len(points_overrides)
    return [k for k, v in values.items()
            if len(v) > 1 or sum(any(records.override_key(o) == k for o in p) for p in points_overrides) < n]


def run_name(overrides: Sequence[str], keys: Optional[Iterable[str]] = None) -> str:
    """The run named by its overrides, e.g. 'loss.top_p=0.9,balancer.alpha=0.5'.

    hydra overrides are dropped; with ``keys`` only those keys are kept (e.g. the swept ones, see sweep_keys).
    A run without overrides is named 'defaults'.
    """
    keep = None if keys is None else set(keys)
    parts = [o for o in overrides if _kept(o) and (keep is None or records.override_key(o) in keep)]
    return ",".join(parts) if parts else "defaults"


def wandb_group(cfg: Any) -> Optional[str]:
    """One W&B group per sweep: the sweep dir's name (with its date folder, e.g. '2026-12-02_17-34-40-ab12cd').

    ``cfg`` is the sweep dir itself (str/Path), the Hydra config (HydraConfig.get()) or a full config with a
    ``hydra`` node; None for a single run (a Hydra config whose mode is not MULTIRUN).
    """
    if isinstance(cfg, (str, os.PathLike)):
        sweep_dir = Path(cfg)
    else:
        h = hydra_node(cfg)
        if not is_multirun(h):
            return None
        sweep_dir = Path(str(h["sweep"]["dir"]))
    parent = sweep_dir.parent.name
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", parent):
        return f"{parent}_{sweep_dir.name}"
    return sweep_dir.name


def job_type(cfg: Any) -> str:
    """'sweep' for a point of a multirun, 'run' for a single run."""
    return "sweep" if is_multirun(hydra_node(cfg)) else "run"


def wandb_names(cfg: Any) -> dict:
    """group, name and job_type for wandb.init. Reads sweep.json (written by SweepCallback) to name a point by its
    swept overrides only; falls back to all its overrides when there is no sweep.json."""
    h = hydra_node(cfg)
    overrides = list(h["overrides"]["task"])
    return {"group": wandb_group(h), "name": run_name(overrides, swept_keys(h)), "job_type": job_type(h)}


def swept_keys(cfg: Any) -> Optional[list[str]]:
    """The keys this run's sweep varies (from sweep.json's planned points), None outside a multirun or without a
    plan of two or more points."""
    h = hydra_node(cfg)
    if not is_multirun(h):
        return None
    sweep = records.read_json(Path(str(h["sweep"]["dir"])) / records.SWEEP) or {}
    planned = [p["overrides"] for p in sweep.get("points", []) if p.get("overrides") is not None]
    return sweep_keys(planned) if len(planned) > 1 else None
