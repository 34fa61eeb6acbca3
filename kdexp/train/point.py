"""One run (or one sweep point) from start to summary.json: reuse, resume, train, record.

- A run dir that already holds a finished summary.json for the same config is not retrained.
- In a sweep, a point whose resolved config (``kdexp.config.config_hash``) finished in an earlier sweep is reused
  (its summary copied, ``reused_from`` set) and one that was interrupted resumes from that run's checkpoints.
- Exceptions propagate: in a sweep ``kdexp.track.sweep.SweepCallback`` records the failing point (its traceback in
  its own log, point.json and sweep.json) and lets the other points go on.
"""
from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from kdexp import distributed
from kdexp.config import config_hash
from kdexp.track import rundir, sweep
from kdexp.track.wandb_logger import WandbLogger

log = logging.getLogger("kdexp")


def _quiet_megatron() -> None:
    """megatron-core logs every dataset index step at INFO and warns about optional fused kernels it can do without."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*(Apex|apex|TransformerEngine|transformer_engine).*")


def _identity(cfg):
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return Path(hc.runtime.output_dir), multirun, list(hc.overrides.task), hc


def run_point(cfg) -> dict:
    run_dir, multirun, overrides, hc = _identity(cfg)
    key = config_hash(cfg)
    rank0 = sweep.global_rank() == 0  # before any process group exists
    done = rundir.read_json(run_dir / "summary.json")
    if done is not None and done.get("config_hash") == key:
        if rank0:
            log.info("already finished: %s", run_dir / "summary.json")
        return done
    if done is not None and rank0:  # another config finished here before: its summary must not stand for this run
        (run_dir / "summary.json").unlink()

    index = rundir.PointIndex(cfg.paths.index)
    previous = index.lookup(key) if (multirun and cfg.trainer.reuse_finished) else None
    if previous is not None and previous.resolve() != run_dir.resolve():
        earlier = rundir.read_json(previous / "summary.json")
        if earlier is not None:
            summary = {**earlier, "overrides": overrides, "reused_from": str(previous)}
            if rank0:
                rundir.write_json(run_dir / "summary.json", summary)  # SweepCallback marks the point reused
                log.info("reused finished point %s (same resolved config %s)", previous, key)
            return summary
    else:
        previous = None
    if rank0 and index.lookup(key) is None:
        index.claim(key, run_dir)

    started = time.perf_counter()
    _quiet_megatron()
    distributed.initialize(tensor_parallel=cfg.parallel.tensor, pipeline_parallel=cfg.parallel.pipeline,
                           seed=cfg.trainer.seed)
    from kdexp.train.loop import distill  # megatron is imported only once the config is known good

    wandb_logger = WandbLogger(cfg, run_dir, enabled=distributed.is_rank0(), overrides=overrides,
                               **sweep.wandb_names(hc))
    try:
        final, student = distill(cfg, run_dir, config_hash=key, resume_from=previous, wandb_logger=wandb_logger)
        if cfg.trainer.export_hf:  # every rank: save_hf gathers the TP shards, rank 0 writes
            from kdexp.models import save_hf

            save_hf(student, run_dir / "student_hf")  # the spec rides on the model (model.kdexp_spec)
    except BaseException:
        wandb_logger.finish(exit_code=1)
        raise  # in a sweep, SweepCallback records it (point.json, error.log) and the other points go on

    summary = {"status": "finished", "config_hash": key, "overrides": overrides, "steps": cfg.trainer.max_steps,
               "wall_s": time.perf_counter() - started, "final": final, "reused_from": None,
               "run_dir": str(run_dir)}
    if distributed.is_rank0():
        wandb_logger.summary(final)
        rundir.write_json(run_dir / "summary.json", summary)  # last: its presence means the run finished
        index.claim(key, run_dir)  # later identical points reuse this finished run (it may have resumed another's)
        log.info("run dir: %s\n  metrics: %s\n  summary: %s%s", run_dir, run_dir / "metrics.jsonl",
                 run_dir / "summary.json",
                 f"\n  W&B: {run_dir / 'wandb'} (sync with: wandb sync {run_dir / 'wandb'}/offline-run-*)"
                 if wandb_logger.run is not None else "")
    wandb_logger.finish()
    return summary
