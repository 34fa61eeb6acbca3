"""W&B for one run: offline by default, online when WANDB_MODE / logger.wandb.mode says so; rank 0 only.

The run writes into ``<run_dir>/wandb``; its id is kept in ``<run_dir>/wandb_id`` so a resumed run (after a kill or a
SLURM requeue) continues the same W&B run. In a sweep the group is the sweep's directory name and the run is named by
its overrides. With W&B offline nothing is lost: ``wandb sync <run_dir>/wandb/offline-run-*`` uploads later.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf


class WandbLogger:
    def __init__(self, cfg, run_dir: Path, *, enabled: bool, name: str, group: Optional[str], job_type: str,
                 overrides: Optional[list] = None):
        self.run = None
        if not (enabled and cfg.logger.wandb.enabled):
            return
        import wandb

        w = cfg.logger.wandb
        mode = w.mode or os.environ.get("WANDB_MODE") or "offline"
        id_file = Path(run_dir) / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=w.project, entity=w.entity, group=w.group or group, name=name, job_type=job_type,
            tags=list(w.tags), dir=str(run_dir), id=run_id, resume="allow", mode=mode,
            # the overrides too, so a report from the W&B group sees the same swept keys as one from run dirs
            config={**OmegaConf.to_container(cfg, resolve=True), "overrides": list(overrides or [])}, settings=wandb.Settings(console="off", quiet=True))

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if k not in ("step", "kind")}, step=step)

    def summary(self, final: dict) -> None:
        if self.run is not None:
            self.run.summary.update(final)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
