"""A run's loggers beside metrics.jsonl: W&B (kdexp.track.wandb_logger) and TensorBoard (kdexp.track.tensorboard),
behind one object the training loop logs to, and what they are told about the run.

``RunContext`` is what a logger knows besides the config: the W&B group / name / job type (kdexp.track.naming), the
overrides, the keys the sweep varies and Hydra's group choices (experiment, arm). ``run_tags`` turns that into W&B
tags. ``log_reused`` gives a point that reused an earlier sweep's finished run its own W&B run (and TensorBoard
events) in the new sweep, marked ``reused_from``, holding the original's metrics, so the new group is complete.
Only global rank 0 logs (the caller passes ``enabled``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kdexp.track import records, tensorboard
from kdexp.track.naming import swept_keys, wandb_names
from kdexp.track.wandb_logger import WandbLogger

MAX_TAG = 64  # W&B rejects longer tags


@dataclass
class RunContext:
    group: Optional[str] = None
    name: str = "defaults"
    job_type: str = "run"
    overrides: list[str] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)  # override keys the sweep varies (its other points differ in)
    choices: dict[str, str] = field(default_factory=dict)  # Hydra config group -> option (experiment, arm, ...)
    sweep_dir: Optional[Path] = None  # the multirun's dir (None for a single run)

    @classmethod
    def from_hydra(cls, hc: Any, overrides: Optional[list] = None) -> "RunContext":
        """From HydraConfig.get() (or a config with a hydra node) of the running job."""
        names = wandb_names(hc)
        choices = {str(k): str(v) for k, v in dict(_get(_get(hc, "runtime"), "choices") or {}).items()
                   if v is not None and not records.is_hydra_key(str(k))}
        task = list(overrides if overrides is not None else _get(_get(hc, "overrides"), "task") or [])
        sweep_dir = _get(hc, "sweep") if names["job_type"] == "sweep" else None
        return cls(group=names["group"], name=names["name"], job_type=names["job_type"], overrides=task,
                   swept=list(swept_keys(hc) or []), choices=choices,
                   sweep_dir=Path(str(_get(sweep_dir, "dir"))) if sweep_dir is not None else None)


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    return node.get(key) if hasattr(node, "get") else getattr(node, key, None)


def _select(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = _get(node, part)
    return node


def run_tags(cfg: Any, ctx: RunContext) -> list[str]:
    """W&B tags: loss:<name>, teacher:<kind>, experiment:<name>, arm:<name>, swept:<key> (those that apply)."""
    tags = [f"loss:{_select(cfg, 'loss.name')}", f"teacher:{_select(cfg, 'teacher.name')}"]
    if ctx.choices.get("experiment"):
        tags.append(f"experiment:{ctx.choices['experiment']}")
    arm = _select(cfg, "experiment_arm") or ctx.choices.get("arm")
    if arm:
        tags.append(f"arm:{arm}")
    tags += [f"swept:{k}" for k in ctx.swept]
    return [t if len(t) <= MAX_TAG else t[:MAX_TAG - 3] + "..." for t in tags]


class RunLoggers:
    """W&B and TensorBoard for one run, with WandbLogger's interface (log, summary, finish, run)."""

    def __init__(self, cfg, run_dir: Path, ctx: RunContext, *, enabled: bool, reused_from: Optional[str] = None):
        extra = {"reused_from": reused_from} if reused_from else None
        tags = run_tags(cfg, ctx) + (["reused"] if reused_from else [])
        self.wandb = WandbLogger(cfg, run_dir, enabled=enabled, name=ctx.name, group=ctx.group,
                                 job_type=ctx.job_type, overrides=ctx.overrides, tags=tags, extra_config=extra)
        self.tensorboard = None
        if enabled and tensorboard.enabled_in(cfg):
            self.tensorboard = tensorboard.TensorBoardLogger(run_dir, name=ctx.name, overrides=ctx.overrides,
                                                             sweep_dir=ctx.sweep_dir, reused_from=reused_from)

    @property
    def run(self):
        return self.wandb.run

    def log(self, metrics: dict, step: int) -> None:
        self.wandb.log(metrics, step)
        if self.tensorboard is not None:
            self.tensorboard.log(metrics, step)

    def summary(self, final: dict) -> None:
        self.wandb.summary(final)
        if self.tensorboard is not None:
            self.tensorboard.summary(final)

    def finish(self, exit_code: int = 0) -> None:
        self.wandb.finish(exit_code)
        if self.tensorboard is not None:
            self.tensorboard.close(exit_code)
            self.tensorboard = None


def open_loggers(cfg, run_dir: Path, hc: Any, *, enabled: bool, overrides: Optional[list] = None) -> RunLoggers:
    """The run's loggers (train.point's entry point)."""
    return RunLoggers(cfg, Path(run_dir), RunContext.from_hydra(hc, overrides), enabled=enabled)


def log_reused(cfg, run_dir: Path, hc: Any, summary: dict, *, enabled: bool,
               overrides: Optional[list] = None) -> Optional[RunLoggers]:
    """A reused point in the new sweep's W&B group (and TensorBoard): a run named as the point, tagged ``reused``,
    its config carrying ``reused_from`` (the original run dir), its history replayed from the original's
    metrics.jsonl and its summary the original's final metrics. None when nothing logs (not rank 0)."""
    if not enabled:
        return None
    source = summary.get("reused_from")
    loggers = RunLoggers(cfg, Path(run_dir), RunContext.from_hydra(hc, overrides), enabled=True,
                         reused_from=source)
    try:
        if source:
            for row in records.read_jsonl(Path(source) / records.METRICS):
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    loggers.log(row, row["step"])
        loggers.summary({**(summary.get("final") or {}), "reused_from": source})
    finally:
        loggers.finish()
    return loggers


__all__ = ["RunContext", "RunLoggers", "run_tags", "open_loggers", "log_reused"]
