"""One run (or one sweep point) from start to summary.json: reuse, resume, train, record.

- A run dir that already holds a finished summary.json for the same config is not retrained.
- In a sweep, a point whose resolved config (``kdexp.config.config_hash``) finished in an earlier sweep is reused
  (its summary copied, ``reused_from`` set) and one that was interrupted resumes from that run's checkpoints.
- Exceptions propagate: in a sweep ``kdexp.track.sweep.SweepCallback`` records the failing point (its traceback in
  its own log, point.json and sweep.json) and lets the other points go on; a single run writes its traceback to its
  run.log and error.log here.
- A non-finite step raises ``Diverged``: summary.json gets status "diverged" (step, message, last finite metrics,
  last finite checkpoint), then it propagates (exit status != 0). A rerun of a diverged config is refused with the
  same error (not retrained: it would diverge again); deleting its summary.json retries from its last checkpoint.
"""
from __future__ import annotations

import logging
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from kdexp import distributed
from kdexp.config import config_hash
from kdexp.track import claim, faults, records, rundir, sweep
from kdexp.train.errors import Diverged
from kdexp.track.cost import run_cost
from kdexp.track.loggers import log_reused, open_loggers

log = logging.getLogger("kdexp")


def model_labels(cfg) -> dict:
    """Per role, what the run trains and distills from: the checkpoint's label and shape read from its config.json
    (kdexp.models.label: its size name when it has a Qwen3 size's shape), else the size name (a tiny preset's
    vocabulary is the tokenizer's)."""
    from kdexp import assets, models

    out = {}
    for role in ("teacher", "student"):
        path = assets.teacher_checkpoint(cfg.model) if role == "teacher" else cfg.model.student_path
        if path is None:
            out[role] = {"label": models.size_key(getattr(cfg.model, role))}
            continue
        spec = models.spec_from_hf(models.read_config(path))
        out[role] = {"label": models.label(spec, path), "path": str(path), "params": spec.num_params(),
                     "shape": models.shape_of(spec)}
    return out


def quiet_megatron() -> None:
    """megatron-core logs every dataset index step at INFO and warns about optional fused kernels it can do without.
    The filters name megatron's modules, so that a warning of kdexp's (or another library's) with the same words
    still shows."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*", module=r"megatron\.")
    warnings.filterwarnings("ignore", message=".*(Apex|apex|TransformerEngine|transformer_engine).*", module=r"megatron\.")
    # megatron's sequence-parallel collectives call torch's old names (all_gather_into_tensor, reduce_scatter_tensor):
    # torch's deprecation notice is about megatron's code, not the user's
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)
    import torch

    if not torch.cuda.is_available():  # CUDA-only advice on a CPU run (CUDA_DEVICE_MAX_CONNECTIONS for SP overlap)
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*", module=r"megatron\.")


def _identity(cfg):
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return Path(hc.runtime.output_dir), multirun, list(hc.overrides.task), hc


def _diverged_before(run_dir: Path, earlier: dict, where: Path) -> Diverged:
    """A rerun of a config that diverged: not retrained (it would diverge again), and not a success either."""
    ckpt = earlier.get("checkpoint")
    retry = (f"delete {where / records.SUMMARY} to retry from its last finite checkpoint (step {ckpt})"
             if ckpt is not None else f"delete {where} to retry from step 0")
    return Diverged(f"{run_dir}: this config diverged before in {where} at step {earlier.get('step')}; not "
                    f"retrained: {retry}, or change the config (e.g. trainer.skip_nonfinite, trainer.lr). "
                    f"It said: {earlier.get('error')}", step=earlier.get("step") or 0,
                    metrics=earlier.get("final"), skipped=earlier.get("skipped_steps") or 0, checkpoint=ckpt)


def _wait_for(previous: Path, rank0: bool, poll_s: float = 2.0) -> None:
    """Block while a live process holds ``previous`` (its run dir lock, kdexp.track.claim): two sweeps started
    together on one cold cache, or a rerun beside an orphaned worker, never train or copy one config midway; once
    it is free, what it left is verified as usual (a finished run is reused, an interrupted one resumed)."""
    who = claim.holder(previous)
    if who is None:
        return
    if rank0:
        log.info("waiting for the run of %s, which trains this config in %s", who, previous)
    while claim.holder(previous) is not None:
        time.sleep(poll_s)


def run_point(cfg, *, flops_per_token: Callable[[Any], dict]) -> dict:
    """Run (or reuse) one point. A failure outside a sweep leaves its traceback in run.log and error.log (in a sweep,
    SweepCallback records it); a divergence also leaves summary.json with status "diverged"; then it re-raises.
    ``flops_per_token(cfg)``: the model FLOPs per trained token its cost record counts (kdexp.plan.flops_per_token)."""
    run_dir, multirun, overrides, hc = _identity(cfg)
    try:
        result = _run_point(cfg, run_dir, multirun, overrides, hc, flops_per_token)
        distributed.ended_cleanly()  # the process group goes at exit (gloo's threads otherwise may abort it)
        return result
    except Exception as exc:
        heading = faults.ending(exc).traceback_as  # a disk fault or a config error is one line (kdexp.run)
        if not multirun and sweep.global_rank() == 0 and heading is not None:
            records.write_error(run_dir, heading, traceback.format_exc())
        raise


def _run_point(cfg, run_dir: Path, multirun: bool, overrides: list, hc,
               flops_per_token: Callable[[Any], dict]) -> dict:
    key = config_hash(cfg)
    rank0 = sweep.global_rank() == 0  # before any process group exists
    done = records.read_json(run_dir / records.SUMMARY)
    if done is not None and done.get("config_hash") == key:
        if done.get("status") == "diverged":
            raise _diverged_before(run_dir, done, run_dir)
        if rank0:
            log.info("already finished: %s", run_dir / records.SUMMARY)
        return done
    if done is not None and rank0:  # another config finished here before: its summary must not stand for this run
        (run_dir / records.SUMMARY).unlink()

    index = rundir.PointIndex(cfg.paths.index)
    previous = index.lookup(key) if (multirun and cfg.trainer.reuse_finished) else None
    if previous is not None and previous.resolve() != run_dir.resolve():
        _wait_for(previous, rank0)  # another live process trains this config there: its outcome, not a copy midway
        earlier, problem = rundir.verified_summary(previous, key, intervals={
            "log_interval": cfg.trainer.log_interval, "eval_interval": cfg.trainer.eval_interval,
            "max_steps": cfg.trainer.max_steps})
        if problem is not None and rank0:
            log.warning("not reusing %s: %s; training this point", previous, problem)
        if earlier is not None and earlier.get("status") in (*records.ENDED_WELL, "diverged"):
            summary = {**earlier, "overrides": overrides, "reused_from": str(previous),
                       "wandb_id": earlier.get("wandb_id") or rundir.wandb_id(previous)}
            if rank0:
                # the point keeps its own copy of the curves and the W&B id of the run that trained it, so that it
                # still has them when the sweep it came from is moved or deleted
                rundir.copy_record(previous, run_dir)
                records.write_json(run_dir / records.SUMMARY, summary)  # SweepCallback marks the point reused
                log.info("reused %s point %s (same resolved config %s)",
                         "diverged" if earlier["status"] == "diverged" else "finished", previous, key)
            if earlier["status"] == "diverged":
                raise _diverged_before(run_dir, earlier, previous)
            log_reused(cfg, run_dir, hc, summary, enabled=rank0, overrides=overrides)  # in this sweep's W&B group
            return summary
    else:
        previous = None
    if rank0 and index.lookup(key) is None:
        index.claim(key, run_dir)

    sweep_dir = rundir.sweep_dir(hc) if multirun else None

    def waiting(flag: bool) -> None:  # the local executor: pending in sweep.json while it waits for a slot
        if rank0:
            sweep.record_point(run_dir, "pending" if flag else "running", waiting_for="a local slot" if flag else None)
            sweep.rebuild_sweep(sweep_dir)

    sweep.take_local_slot(cfg.launch, sweep_dir, on_wait=waiting)
    started = time.perf_counter()
    quiet_megatron()
    distributed.initialize(tensor_parallel=cfg.parallel.tensor, pipeline_parallel=cfg.parallel.pipeline,
                           seed=cfg.trainer.seed)
    from kdexp.train.loop import distill  # megatron is imported only once the config is known good

    wandb_logger = open_loggers(cfg, run_dir, hc, enabled=distributed.is_rank0(), overrides=overrides)
    record = {"config_hash": key, "overrides": overrides, "steps": cfg.trainer.max_steps, "reused_from": None,
              "resumed_from": None, "trained_steps": cfg.trainer.max_steps, "run_dir": str(run_dir),
              "wandb_id": rundir.wandb_id(run_dir), "models": model_labels(cfg)}
    if distributed.is_rank0():
        log.info("teacher %s -> student %s", *(f"{m['label']} ({m['shape']})" if "shape" in m else m["label"]
                                                for m in record["models"].values()))

    def resumed(where: Path, step: int) -> None:  # what this process trains: the steps after that checkpoint
        record.update(resumed_from={"run_dir": str(Path(where).resolve()), "step": step},
                      trained_steps=cfg.trainer.max_steps - step)

    try:
        # with trainer.export_hf, distill writes run_dir/student_hf (weights, tokenizer, generation config)
        final, _ = distill(cfg, run_dir, config_hash=key, resume_from=previous, wandb_logger=wandb_logger,
                           on_resume=resumed)
    except Diverged as exc:
        if distributed.is_rank0():
            wandb_logger.summary({**exc.metrics, "diverged_step": exc.step})
            records.write_json(run_dir / records.SUMMARY, {  # strict JSON; the last finite metrics
                **record, "status": "diverged", "step": exc.step, "error": str(exc), "final": exc.metrics,
                "skipped_steps": exc.skipped, "checkpoint": exc.checkpoint,
                "wall_s": time.perf_counter() - started})
            log.error("%s\n  run dir: %s", exc, run_dir)
        wandb_logger.finish(exit_code=1)
        raise
    except BaseException:
        wandb_logger.finish(exit_code=1)
        raise  # in a sweep, SweepCallback records it (point.json, error.log) and the other points go on

    wall_s = time.perf_counter() - started
    summary = {**record, "status": "finished", "wall_s": wall_s, "final": final,
               "skipped_steps": int(final.get("train/skipped_steps", 0)),
               "cost": run_cost(cfg, wall_s=wall_s, flops_per_token=flops_per_token,  # kdexp.track.cost
                                device=distributed.state().device, steps=record["trained_steps"])}
    if distributed.is_rank0():
        wandb_logger.summary({**final, "cost": summary["cost"]})  # W&B keeps the cost too (a report from the group)
        records.write_json(run_dir / records.SUMMARY, summary)  # last: its presence means the run finished
        index.claim(key, run_dir)  # later identical points reuse this finished run (it may have resumed another's)
        log.info("run dir: %s\n  metrics: %s\n  summary: %s%s", run_dir, run_dir / "metrics.jsonl",
                 run_dir / records.SUMMARY,
                 f"\n  W&B: {run_dir / 'wandb'} (sync with: wandb sync {run_dir / 'wandb'}/offline-run-*)"
                 if wandb_logger.run is not None else "")
    wandb_logger.finish()
    return summary
