"""Run and sweep directories: one agreed name per launch, where a sweep's dir is, and the finished-point index.

``kdexp_stamp`` is the OmegaConf resolver behind ``hydra.run.dir`` and ``hydra.sweep.dir``: a date, a time and a short
random id, so two runs (or sweeps) started in the same second never share a directory. Under torchrun every rank runs
Hydra, so ``agree_on_stamp()`` lets rank 0 choose the stamp and hands it to the others before Hydra starts.

``kdexp_uid`` is a short random id, the same for every interpolation in one process and, through Hydra's resolver
cache, in every job of one sweep (a sweep dir that names no time at all still never collides).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from kdexp.distributed.launch import launch_env
from kdexp.track import records
from kdexp.track.records import read_json, write_json

_STAMP_KEY = "KDEXP_RUN_STAMP"
_stamp_value: Optional[str] = None


def _stamp() -> str:
    # Once per process (so every interpolation agrees), and kept in the process, not in os.environ: a child process
    # (a second sweep started by a script, a test) must draw its own.
    global _stamp_value
    if _stamp_value is None:
        _stamp_value = time.strftime("%Y-%m-%d/%H-%M-%S-") + uuid.uuid4().hex[:6]
    return _stamp_value


# use_cache=True, like kdexp_uid below: a submitit worker (local or SLURM) resolves hydra.sweep.dir in its own process,
# seconds after the submitting one, and must get the submitting process's stamp from the pickled resolver cache, not
# a time of its own (without it every local_cpu point of a default `multirun/${kdexp_stamp:}` sweep made its own dir).
if not OmegaConf.has_resolver("kdexp_stamp"):
    OmegaConf.register_new_resolver("kdexp_stamp", _stamp, use_cache=True)


_UID: Optional[str] = None


def sweep_uid() -> str:
    """A 6-hex-digit random id, drawn once per process so every interpolation in this process agrees."""
    global _UID
    if _UID is None:
        _UID = uuid.uuid4().hex[:6]
    return _UID


# use_cache=True stores the value in the config's resolver cache; Hydra copies the submitting process's cache into
# every job's config (ConfigLoaderImpl.load_sweep_config -> OmegaConf.copy_cache) and pickles it to submitit workers,
# so a SLURM task (or a requeued one) resolves the same sweep dir as the process that submitted it.
if not OmegaConf.has_resolver("kdexp_uid"):
    OmegaConf.register_new_resolver("kdexp_uid", sweep_uid, use_cache=True)


def sweep_dir(hydra_cfg) -> Path:
    """Absolute sweep dir. A relative hydra.sweep.dir is relative to the directory Hydra was started in
    (hydra.runtime.cwd), not to the job's cwd (which hydra.job.chdir may have moved)."""
    path = Path(str(hydra_cfg.sweep.dir))
    if not path.is_absolute():
        cwd = OmegaConf.select(hydra_cfg, "runtime.cwd") if OmegaConf.is_config(hydra_cfg) else None
        path = Path(cwd or os.getcwd()) / path
    return path.resolve()


def agree_on_stamp() -> None:
    """Under torchrun, make every rank use rank 0's stamp and keep Hydra's files and logs to rank 0."""
    launch = launch_env()
    global _stamp_value
    if launch.world_size <= 1 or launch.source != "torchrun" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    rank, world = launch.rank, launch.world_size
    # torchrun's agent hosts a TCPStore on MASTER_PORT for the whole job (TORCHELASTIC_USE_AGENT_STORE): every rank
    # joins it as a client, before Hydra and before kdexp.distributed creates the process group.
    store = PrefixStore(f"kdexp/{os.environ['TORCHELASTIC_RUN_ID']}/", TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
        timeout=timedelta(seconds=300)))
    if rank == 0:
        store.set(_STAMP_KEY, _stamp())
    _stamp_value = store.get(_STAMP_KEY).decode()
    if rank != 0:
        # no run.log handler either: conf/config.yaml names run.log's handler class (kdexp.track.claim.RunLog), which
        # would otherwise stay on the disabled config as a handler without a file
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "~hydra.job_logging.handlers",
                     "hydra/hydra_logging=disabled"]


class PointIndex:
    """Finished and started points keyed by config hash, so an identical sweep re-run retrains nothing.

    ``<index>/<hash>.json`` = {"run_dir": first run dir that trained this config}. A new run of the same config
    reuses that dir's summary when it finished, or resumes from its checkpoints when it was interrupted.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def lookup(self, key: str) -> Optional[Path]:
        entry = read_json(self.root / f"{key}.json")
        if entry is None or not Path(entry["run_dir"]).is_dir():
            return None
        return Path(entry["run_dir"])

    def claim(self, key: str, run_dir: Path) -> None:
        write_json(self.root / f"{key}.json", {"run_dir": str(Path(run_dir).resolve())})


# ----------------------------------------------------------------------------------------------------------------------
# whose run a run dir holds


class RunDirTaken(ValueError):
    """A run dir that holds another config's run: refused before anything is written (exit 2 for a single run;
    kdexp.track.claim)."""


def owner(run_dir: Path) -> Optional[str]:
    """The config hash of the run ``run_dir`` holds: its run.json (written when a run starts), else its summary.json
    (a run that ended before run.json existed); None for a dir that holds no run."""
    for name in (records.RUN, records.SUMMARY):
        data = read_json(Path(run_dir) / name)
        if isinstance(data, dict) and isinstance(data.get("config_hash"), str):
            return data["config_hash"]
    return None


# ----------------------------------------------------------------------------------------------------------------------
# reusing a finished point of an earlier sweep


def wandb_id(run_dir: Path) -> Optional[str]:
    """The W&B run id a run dir's run logged to (kdexp.track.wandb_logger keeps it in ``wandb_id``), or None."""
    try:
        return (Path(run_dir) / "wandb_id").read_text().strip() or None
    except OSError:
        return None


def verified_summary(previous: Path, key: str, intervals: Optional[dict] = None) -> tuple[Optional[dict], Optional[str]]:
    """(the summary of ``previous``, None) when it is the ended run of config ``key`` with the files it claims, else
    (None, why not). The points index only says where a config ran once; the dir may since hold another run, be
    torn or be a copy: what is reused is checked, not trusted. ``intervals`` (log_interval, eval_interval,
    max_steps of the config): a finished run's metrics.jsonl must hold every line it logged, not only its last."""
    previous = Path(previous)
    summary = read_json(previous / records.SUMMARY)
    if not isinstance(summary, dict):
        return None, f"its {records.SUMMARY} is missing or unreadable"
    if summary.get("config_hash") != key:
        return None, f"its {records.SUMMARY} is of config {summary.get('config_hash')}, not {key}"
    held = owner(previous)
    if held != key:
        return None, f"it now holds the run of config {held}"
    if records.ended_status(summary) is None:
        return None, f"its {records.SUMMARY} has no ended status ({summary.get('status')!r})"
    lines = records.read_jsonl(previous / records.METRICS)
    if summary.get("status") == "finished":
        steps = [r.get("step") for r in lines if r.get("kind") == "train"]
        if not steps or max(steps) != summary.get("steps"):
            return None, (f"its {records.METRICS} ends at step {max(steps) if steps else None}, its summary says "
                          f"{summary.get('steps')} steps")
        gap = records.gap_line(records.missing_steps(lines, summary["steps"], **intervals)) if intervals else None
        if gap is not None:
            return None, f"its {records.METRICS} lacks {gap}"
    return summary, None


def copy_record(previous: Path, run_dir: Path) -> None:
    """The curves (metrics.jsonl) and the W&B id of ``previous`` into ``run_dir`` (a reused point), atomically."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (records.METRICS, "wandb_id"):
        src = Path(previous) / name
        if src.is_file():
            tmp = run_dir / f".{name}.tmp"
            shutil.copyfile(src, tmp)
            os.replace(tmp, run_dir / name)
