"""The one place kdexp relies on Hydra internals (Hydra 1.3): planning a sweep's points and a job's outcome.

Private APIs used here, and nowhere else:
  - the basic sweeper's expansion of a sweep into points (kdexp.config.multirun.expand, which the submitting process
    also uses to check every point first), to list them before they launch (sweep.json starts with every point
    pending);
  - ``JobReturn._return_value``: the exception of a failed job (the public ``return_value`` re-raises it);
  - ``HydraConfig.instance().cfg``: the ``{hydra: ...}`` node Hydra itself saves as ``.hydra/hydra.yaml``.

``.hydra/``: Hydra's ``run_job`` makes the run dir and writes ``.hydra/{config,hydra,overrides}.yaml`` before any
callback or the task runs, so a run refused by its checks would already have rewritten another run's labels. kdexp's
config sets ``hydra.output_subdir`` to null and ``save_job_files`` writes the same three files once the run has
claimed its dir (kdexp.track.claim).

What Hydra 1.3 does with a failing job, and why SweepCallback acts in on_job_end (read from hydra/core/utils.py,
hydra/_internal/core_plugins/basic_{launcher,sweeper}.py, hydra_plugins/hydra_submitit_launcher/submitit_launcher.py):
  - ``run_job`` catches any Exception from the task function into ``JobReturn(status=FAILED, return_value=exc)`` and
    still calls ``on_job_end``; it never raises itself.
  - The basic launcher runs the whole batch (the basic sweeper's default ``max_batch_size`` is None = one batch of
    every point), and only afterwards the sweeper reads ``r.return_value`` of each result, which re-raises the first
    failure: the multirun dies there, ``on_multirun_end`` never runs, later batches never start, exit status 1.
  - The submitit launcher runs ``run_job`` inside each SLURM/local task and returns ``j.results()[0]`` (rank 0's
    JobReturn) to the same sweeper check, so the same happens after all array jobs end. A task that dies without
    returning (killed, OOM, out of requeues) makes ``j.results()`` raise in the submitting process at once; the other
    array jobs keep running on the cluster and keep updating sweep.json themselves.
  - Exceptions raised by callbacks are turned into warnings by Hydra, so bookkeeping bugs never kill a sweep; a
    ``SystemExit`` is not an Exception and does end the process (how on_multirun_end sets the exit status).
So with ``keep_going`` the callback records the failure and marks the JobReturn COMPLETED (``keep_going_past``),
which lets the sweeper go on, like ``make -k``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from omegaconf import OmegaConf


def hydra_node(cfg: Any) -> Any:
    """Accept the full config (with a ``hydra`` node), HydraConfig.get(), or a plain mapping shaped like either."""
    if isinstance(cfg, Mapping) or OmegaConf.is_config(cfg):
        if "hydra" in cfg:
            return cfg["hydra"]
    return cfg


def is_multirun(hydra_cfg: Any) -> bool:
    mode = hydra_cfg.get("mode") if hasattr(hydra_cfg, "get") else None
    return str(mode).split(".")[-1].upper() == "MULTIRUN"


def current_job() -> Optional[Any]:
    """HydraConfig.get() of the job this process runs, or None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def plan_points(hydra_cfg: Any) -> Optional[list[list[str]]]:
    """The overrides of every point the basic sweeper will launch, in job-number order (kdexp.config.multirun.expand,
    the expansion the submitting process checked); None when unknown (another sweeper, or sweep syntax that needs the
    config repository such as glob())."""
    from kdexp.config.multirun import BASIC_SWEEPER, expand

    sweeper = hydra_cfg.get("sweeper", {}) or {}
    if not str(sweeper.get("_target_", "")).endswith(BASIC_SWEEPER):
        return None
    try:
        return expand(sweeper.get("params"), hydra_cfg.overrides.task)
    except Exception:  # noqa: BLE001 - planning is best effort; the points still appear when they start
        return None


def job_exception(job_return: Any) -> Optional[BaseException]:
    """The exception a failed job raised; None when it completed."""
    from hydra.core.utils import JobStatus

    return job_return._return_value if job_return.status == JobStatus.FAILED else None


def job_value(job_return: Any) -> Any:
    """What a completed job's task function returned (None for a failed one), without re-raising."""
    return None if job_exception(job_return) is not None else job_return._return_value


def save_job_files(hydra_dir, job) -> None:
    """``.hydra/config.yaml`` (the task config ``job``), ``hydra.yaml`` and ``overrides.yaml`` of the current job, as
    Hydra's run_job writes them (OmegaConf.to_yaml, interpolations kept), each atomically."""
    import os
    import tempfile
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    hydra_dir = Path(hydra_dir)
    hydra_dir.mkdir(parents=True, exist_ok=True)
    whole = HydraConfig.instance().cfg
    for name, node in (("config.yaml", job), ("hydra.yaml", whole), ("overrides.yaml", whole.hydra.overrides.task)):
        fd, tmp = tempfile.mkstemp(dir=hydra_dir, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(OmegaConf.to_yaml(node))
            os.replace(tmp, hydra_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def keep_going_past(job_return: Any, value: Mapping[str, Any]) -> None:
    """Mark a failed job COMPLETED with ``value``, so the sweeper launches the remaining points (see above)."""
    from hydra.core.utils import JobStatus

    job_return.status = JobStatus.COMPLETED
    job_return.return_value = dict(value)
