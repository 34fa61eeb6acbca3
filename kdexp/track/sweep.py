"""Sweep semantics: a unique directory per sweep, point.json / sweep.json bookkeeping, failure records, W&B names.

Importing this module registers the OmegaConf resolver ``kdexp_uid`` (a short random id, the same for every
interpolation in one process and, through Hydra's resolver cache, in every job of one sweep).

``SweepCallback`` is a Hydra callback (``hydra.callbacks``). In a multirun it
  - on_multirun_start (the submitting process): plans the points (basic sweeper), writes sweep.json with every point
    ``pending`` and prints the count, the sweep dir and the report command;
  - on_job_start / on_job_end (the job's process: basic launcher in-process, submitit on the worker; only global
    rank 0 writes): point.json ``running`` then ``finished`` / ``reused`` / ``failed``, sweep.json rebuilt from all
    point.json files under a file lock, and a progress line;
  - on_multirun_end (the submitting process): the final sweep.json and a summary line.

What Hydra 1.3 does with a failing job, and why the callback acts in on_job_end (read from hydra/core/utils.py,
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
  - Exceptions raised by callbacks are turned into warnings by Hydra, so bookkeeping bugs never kill a sweep.
So with ``keep_going`` (default) on_job_end records the failure (point.json + error.log + run.log) and marks the
JobReturn COMPLETED, which lets the sweeper go on; on_multirun_end then exits with status 1 when any point failed
(``fail_exit``), like ``make -k``. run.py may also catch the exception itself and call ``record_failure``: the
callback keeps that record.
"""
from __future__ import annotations

import datetime as _dt
import os
import re
import socket
import sys
import traceback
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

import kdexp.launchers.site  # noqa: F401  (registers kdexp_site_dir, used by hydra.searchpath)
from kdexp.track.rundir import read_json, write_json

STATUSES = ("pending", "running", "finished", "reused", "failed")
POINT_FILE = "point.json"
SWEEP_FILE = "sweep.json"
# Directories of a run that never hold another run's point.json: not walked when sweep.json is rebuilt.
_SKIP_DIRS = {".hydra", ".submitit", "checkpoints", "wandb", "__pycache__"}

# ---------------------------------------------------------------------------------------------------------------------
# kdexp_uid resolver
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


def global_rank() -> int:
    """Global rank from the launcher's environment: torchrun/exported (RANK), srun (SLURM_PROCID), submitit_local."""
    for key in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        value = os.environ.get(key)
        if value not in (None, ""):
            return int(value)
    return 0


def _slurm_job_id() -> Optional[str]:
    """The id scontrol/scancel take: <array job>_<array task> for an array element, else the job id."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------------------
# W&B naming (pure functions)
def _hydra_node(cfg: Any) -> Any:
    """Accept the full config (with a ``hydra`` node), HydraConfig.get(), or a plain mapping shaped like either."""
    if isinstance(cfg, Mapping) or OmegaConf.is_config(cfg):
        if "hydra" in cfg:
            return cfg["hydra"]
    return cfg


def _is_multirun(hydra_cfg: Any) -> bool:
    mode = hydra_cfg.get("mode") if hasattr(hydra_cfg, "get") else None
    return str(mode).split(".")[-1].upper() == "MULTIRUN"


def override_key(override: str) -> str:
    """'loss.top_p=0.9' -> 'loss.top_p'; '+a.b=1' -> 'a.b'; '~x' -> 'x'; 'loss@x=topk' -> 'loss@x'."""
    key = override.split("=", 1)[0]
    return key.lstrip("+~")


def sweep_keys(points_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Keys whose value differs between the points of a sweep (in first-seen order); hydra.* keys excluded."""
    values: dict[str, set] = {}
    for overrides in points_overrides:
        for o in overrides:
            if not override_key(o).startswith("hydra."):
                values.setdefault(override_key(o), set()).add(o)
    n = len(points_overrides)
    return [k for k, v in values.items()
            if len(v) > 1 or sum(any(override_key(o) == k for o in p) for p in points_overrides) < n]


def run_name(overrides: Sequence[str], keys: Optional[Iterable[str]] = None) -> str:
    """The run named by its overrides, e.g. 'loss.top_p=0.9,balancer.alpha=0.5'.

    hydra.* overrides are dropped; with ``keys`` only those keys are kept (e.g. the swept ones, see sweep_keys).
    A run without overrides is named 'defaults'.
    """
    keep = None if keys is None else set(keys)
    parts = [o for o in overrides
             if not override_key(o).startswith("hydra.") and (keep is None or override_key(o) in keep)]
    return ",".join(parts) if parts else "defaults"


def wandb_group(cfg: Any) -> Optional[str]:
    """One W&B group per sweep: the sweep dir's name (with its date folder, e.g. '2026-12-02_17-34-40-ab12cd').

    ``cfg`` is the sweep dir itself (str/Path), the Hydra config (HydraConfig.get()) or a full config with a
    ``hydra`` node; None for a single run (a Hydra config whose mode is not MULTIRUN).
    """
    if isinstance(cfg, (str, os.PathLike)):
        sweep_dir = Path(cfg)
    else:
        h = _hydra_node(cfg)
        if not _is_multirun(h):
            return None
        sweep_dir = Path(str(h["sweep"]["dir"]))
    parent = sweep_dir.parent.name
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", parent):
        return f"{parent}_{sweep_dir.name}"
    return sweep_dir.name


def job_type(cfg: Any) -> str:
    """'sweep' for a point of a multirun, 'run' for a single run."""
    return "sweep" if _is_multirun(_hydra_node(cfg)) else "run"


def wandb_names(cfg: Any) -> dict:
    """group, name and job_type for wandb.init. Reads sweep.json (written by SweepCallback) to name a point by its
    swept overrides only; falls back to all its overrides when there is no sweep.json."""
    h = _hydra_node(cfg)
    overrides = list(h["overrides"]["task"])
    keys = None
    if _is_multirun(h):
        sweep = read_json(Path(str(h["sweep"]["dir"])) / SWEEP_FILE) or {}
        planned = [p["overrides"] for p in sweep.get("points", []) if p.get("overrides") is not None]
        if len(planned) > 1:
            keys = sweep_keys(planned)
    return {"group": wandb_group(h), "name": run_name(overrides, keys), "job_type": job_type(h)}


# ---------------------------------------------------------------------------------------------------------------------
# point.json / sweep.json
def _sweep_dir(hydra_cfg: Any) -> Path:
    """Absolute sweep dir. A relative hydra.sweep.dir is relative to the directory Hydra was started in
    (hydra.runtime.cwd), not to the job's cwd (which hydra.job.chdir may have moved)."""
    sweep_dir = Path(str(hydra_cfg.sweep.dir))
    if not sweep_dir.is_absolute():
        cwd = OmegaConf.select(hydra_cfg, "runtime.cwd") if OmegaConf.is_config(hydra_cfg) else None
        sweep_dir = Path(cwd or os.getcwd()) / sweep_dir
    return sweep_dir.resolve()


def _hydra_point_fields() -> dict:
    """num, overrides and sweep_dir of the current Hydra job, when there is one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    h = HydraConfig.get()
    fields = {"overrides": list(h.overrides.task)}
    if _is_multirun(h):
        fields["num"] = int(h.job.num)
        fields["sweep_dir"] = str(_sweep_dir(h))
    return fields


def record_point(run_dir: str | Path, status: str, metrics: Optional[Mapping[str, Any]] = None,
                 error: Optional[str] = None, **extra: Any) -> Optional[dict]:
    """Write run_dir/point.json (atomically), keeping the fields an earlier write put there; rank 0 only.

    Returns the written entry (None on other ranks). ``status`` is one of STATUSES.
    """
    if status not in STATUSES:
        raise ValueError(f"record_point: status={status!r} is not one of {', '.join(STATUSES)}")
    if global_rank() != 0:
        return None
    run_dir = Path(run_dir).resolve()
    point = read_json(run_dir / POINT_FILE) or {}
    for k, v in _hydra_point_fields().items():
        point.setdefault(k, v)
    point.setdefault("num", None)
    point.setdefault("overrides", [])
    point.update(extra)
    point.update(run_dir=str(run_dir), status=status, updated=_now(),
                 metrics=dict(metrics) if metrics is not None else point.get("metrics") or {},
                 error=error)
    write_json(run_dir / POINT_FILE, point)
    return point


def record_failure(run_dir: str | Path, exc: BaseException) -> Optional[dict]:
    """Record a failed point: the traceback into run_dir/error.log and run.log, point.json with status failed."""
    if global_rank() != 0:
        return None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    error = f"{type(exc).__name__}: {exc}"
    stamp = _now()
    (run_dir / "error.log").write_text(f"[{stamp}] point failed on {socket.gethostname()}\n{tb}")
    with open(run_dir / "run.log", "a") as f:
        f.write(f"[{stamp}] FAILED: {error}\n{tb}")
    return record_point(run_dir, "failed", error=error, ended=stamp)


def _walk_points(sweep_dir: Path) -> Iterator[dict]:
    for root, dirs, files in os.walk(sweep_dir):
        if POINT_FILE in files:
            point = read_json(Path(root) / POINT_FILE)
            if point is not None:
                yield point
            dirs[:] = []  # a run dir holds no other run
            continue
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]


@contextmanager
def _locked(sweep_dir: Path) -> Iterator[None]:
    """Serialize sweep.json rebuilds across the jobs of a sweep (each writes its point.json before taking the lock,
    so the last one to take it sees every point). Falls back to no lock where flock is not supported."""
    try:
        import fcntl

        f = open(sweep_dir / ".sweep.lock", "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def rebuild_sweep(sweep_dir: str | Path) -> dict:
    """sweep.json from the entries already there (the plan: pending points) and every point.json below sweep_dir."""
    sweep_dir = Path(sweep_dir).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with _locked(sweep_dir):
        old = read_json(sweep_dir / SWEEP_FILE) or {}
        by_key: dict = {}
        for p in old.get("points", []):
            by_key[("num", p["num"]) if p.get("num") is not None else ("dir", p.get("run_dir"))] = p
        for p in _walk_points(sweep_dir):
            by_key.pop(("dir", p.get("run_dir")), None)
            key = ("num", p["num"]) if p.get("num") is not None else ("dir", p.get("run_dir"))
            by_key[key] = {**by_key.get(key, {}), **p}  # keeps the plan's fields (name) under the point's own
        points = sorted(by_key.values(), key=lambda p: (p.get("num") is None, p.get("num") or 0, p.get("run_dir")))
        counts = {s: sum(p.get("status") == s for p in points) for s in STATUSES}
        sweep = {"sweep_dir": str(sweep_dir), "total": old.get("total", len(points)) or len(points),
                 "counts": counts, "updated": _now(), "points": points}
        write_json(sweep_dir / SWEEP_FILE, sweep)
    return sweep


def report_command(sweep_dir: str | Path) -> str:
    return f"python -m kdexp.report {sweep_dir}"


def progress_line(sweep: Mapping[str, Any]) -> str:
    c = sweep["counts"]
    total = max(sweep.get("total") or 0, len(sweep["points"]))
    return (f"[sweep] {c['finished'] + c['reused']}/{total} done, {c['running']} running, {c['failed']} failed"
            f" - report: {report_command(sweep['sweep_dir'])}")


def plan_points(hydra_cfg: Any) -> Optional[list[list[str]]]:
    """The overrides of every point the basic sweeper will launch, in job-number order; None when unknown
    (another sweeper, or sweep syntax that needs the config repository such as glob())."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = hydra_cfg.get("sweeper", {}) or {}
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    args = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()] + list(hydra_cfg.overrides.task)
    try:
        parsed = OverridesParser.create().parse_overrides(args)
        return [list(p) for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]
    except Exception:  # noqa: BLE001 - planning is best effort; the points still appear when they start
        return None


# ---------------------------------------------------------------------------------------------------------------------
class SweepCallback(Callback):
    """Hydra callback keeping sweep.json current; see the module docstring.

    keep_going: a failing point is recorded and the sweep goes on (else Hydra stops after the batch, see above).
    fail_exit: at the end of a multirun with failed points, exit with status 1 (after sweep.json is written).
    """

    def __init__(self, keep_going: bool = True, fail_exit: bool = True) -> None:
        self.keep_going = keep_going
        self.fail_exit = fail_exit

    # submitting process -------------------------------------------------------------------------------------------
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if global_rank() != 0:  # e.g. a multirun started under torchrun: every rank runs Hydra
            return
        sweep_dir = _sweep_dir(config.hydra)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        planned = plan_points(config.hydra)
        if planned is not None:
            keys = sweep_keys(planned)
            points = [{"num": i, "overrides": o, "name": run_name(o, keys), "run_dir": None, "status": "pending",
                       "metrics": {}, "error": None} for i, o in enumerate(planned)]
            write_json(sweep_dir / SWEEP_FILE, {"sweep_dir": str(sweep_dir), "total": len(points), "points": points})
        rebuild_sweep(sweep_dir)
        n = f"{len(planned)} points" if planned is not None else "an unknown number of points"
        print(f"[sweep] {n} -> {sweep_dir}\n[sweep] report: {report_command(sweep_dir)}"
              f" (progress in {sweep_dir / SWEEP_FILE})", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if global_rank() != 0:
            return
        sweep_dir = _sweep_dir(config.hydra)
        sweep = rebuild_sweep(sweep_dir)
        c = sweep["counts"]
        print(f"[sweep] ended: {c['finished']} finished, {c['reused']} reused, {c['failed']} failed,"
              f" {c['running'] + c['pending']} not finished, of {sweep['total']} - {sweep_dir / SWEEP_FILE}"
              f"\n[sweep] report: {report_command(sweep_dir)}", flush=True)
        for p in sweep["points"]:
            if p["status"] == "failed":
                print(f"[sweep] failed #{p.get('num')}: {p.get('name') or run_name(p.get('overrides') or [])}: {p.get('error')}"
                      f" (see {p.get('run_dir')}/error.log)", flush=True)
        if self.fail_exit and c["failed"]:
            raise SystemExit(1)  # not an Exception: Hydra's callback wrapper would turn that into a warning

    # job process ----------------------------------------------------------------------------------------------------
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not _is_multirun(config.hydra) or global_rank() != 0:
            return
        run_dir = Path(config.hydra.runtime.output_dir)
        previous = read_json(run_dir / POINT_FILE) or {}
        # A point.json already there means SLURM requeued this point (timeout/preemption) into the same run dir.
        attempt = int(previous.get("attempt", 0)) + 1
        record_point(run_dir, "running", metrics={}, attempt=attempt, started=_now(), host=socket.gethostname(),
                     slurm_job_id=_slurm_job_id())
        rebuild_sweep(_sweep_dir(config.hydra))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if not _is_multirun(config.hydra):
            return
        failed = job_return.status == JobStatus.FAILED
        exc = job_return._return_value if failed else None
        if failed:  # every rank: the traceback goes to this task's log (submitit keeps one per task)
            sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        if global_rank() == 0:
            self._record_end(config, job_return, exc)
        if failed and self.keep_going:
            job_return.status = JobStatus.COMPLETED
            job_return.return_value = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}

    def _record_end(self, config: DictConfig, job_return: Any, exc: Optional[BaseException]) -> None:
        run_dir = Path(config.hydra.runtime.output_dir)
        previous = read_json(run_dir / POINT_FILE) or {}
        if exc is not None:
            record_failure(run_dir, exc)
        elif previous.get("status") == "failed":
            pass  # run.py caught the exception and called record_failure: keep that record
        else:
            summary = read_json(run_dir / "summary.json")
            if summary is not None:
                status = "reused" if summary.get("reused_from") else "finished"
                metrics = summary.get("final") or {}
            else:
                value = job_return._return_value
                status = "finished"
                metrics = {k: v for k, v in value.items() if isinstance(v, (int, float))} \
                    if isinstance(value, Mapping) else {}
            record_point(run_dir, status, metrics=metrics, ended=_now())
        print(progress_line(rebuild_sweep(_sweep_dir(config.hydra))), flush=True)
