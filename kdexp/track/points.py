"""A sweep's bookkeeping: each point's point.json, the sweep's sweep.json rebuilt from them, and progress lines.

Only global rank 0 writes. point.json lives in the point's run dir and is the truth for that point; sweep.json is
rebuilt from the plan (every point pending) and every point.json below the sweep dir, under a file lock, so the
jobs of a sweep (in-process, submitit workers, SLURM array tasks) never lose each other's updates.
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from kdexp.distributed.launch import global_rank
from kdexp.track import faults, records
from kdexp.track.hydra_adapter import current_job, is_multirun
from kdexp.track.naming import run_name
from kdexp.track.rundir import sweep_dir as hydra_sweep_dir


def slurm_job_id() -> Optional[str]:
    """The id scontrol/scancel take: <array job>_<array task> for an array element, else the job id."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def _hydra_point_fields() -> dict:
    """num, overrides and sweep_dir of the current Hydra job, when there is one."""
    h = current_job()
    if h is None:
        return {}
    fields = {"overrides": list(h.overrides.task)}
    if is_multirun(h):
        fields["num"] = int(h.job.num)
        fields["sweep_dir"] = str(hydra_sweep_dir(h))
    return fields


def record_point(run_dir: str | Path, status: str, metrics: Optional[Mapping[str, Any]] = None,
                 error: Optional[str] = None, **extra: Any) -> Optional[dict]:
    """Write run_dir/point.json (atomically), keeping the fields an earlier write put there; rank 0 only.

    Returns the written entry (None on other ranks). ``status`` is one of records.STATUSES.
    """
    if status not in records.STATUSES:
        raise ValueError(f"record_point: status={status!r} is not one of {', '.join(records.STATUSES)}")
    if global_rank() != 0:
        return None
    run_dir = Path(run_dir).resolve()
    point = records.read_json(run_dir / records.POINT) or {}
    for k, v in _hydra_point_fields().items():
        point.setdefault(k, v)
    point.setdefault("num", None)
    point.setdefault("overrides", [])
    point.update(extra)
    point.update(run_dir=str(run_dir), status=status, updated=records.now(),
                 metrics=dict(metrics) if metrics is not None else point.get("metrics") or {},
                 error=error)
    records.write_json(run_dir / records.POINT, point)
    return point


def record_failure(run_dir: str | Path, exc: BaseException) -> Optional[dict]:
    """A point that raised: its traceback into error.log and run.log (unless the point wrote its own error.log
    already), point.json with status "diverged" when its summary.json says so (the run stopped on a non-finite
    value, its last finite metrics in the summary), else "failed". Rank 0 only."""
    if global_rank() != 0:
        return None
    run_dir = Path(run_dir)
    line = faults.one_line(exc)
    if line is not None:  # a full disk, a refused value: the one line, not a traceback; that disk may not take it
        return _record_line(run_dir, line)
    summary = records.read_json(run_dir / records.SUMMARY)
    diverged = records.ended_status(summary) == "diverged"
    what = "point diverged" if diverged else "point failed"
    records.write_error(run_dir, what, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                        replace=False)
    if diverged:
        return record_point(run_dir, "diverged", metrics=summary.get("final") or {},
                            error=summary.get("error") or f"{type(exc).__name__}: {exc}", ended=records.now(),
                            step=summary.get("step"))
    return record_point(run_dir, "failed", error=f"{type(exc).__name__}: {exc}", ended=records.now())


def _record_line(run_dir: Path, line: str) -> dict:
    """point.json "failed" with `line` as its error (and error.log / run.log), as far as the disk takes them; the
    entry is returned either way, so that the sweep's output carries the line (kdexp.track.callback)."""
    point = {"run_dir": str(run_dir), "status": "failed", "error": line}
    for write in (lambda: records.write_error(run_dir, "point failed", line + "\n", replace=False),
                  lambda: point.update(record_point(run_dir, "failed", error=line, ended=records.now()) or {})):
        try:
            write()
        except OSError as err:
            if faults.disk_fault(err) is None:
                raise
    return point


def set_aside_error_log(run_dir: str | Path, attempt: int) -> None:
    """A requeued point starts over in the same run dir: an error.log of an earlier attempt becomes
    error.log.attempt<N> (kept, but no longer this attempt's error: record_failure never replaces an error.log)."""
    old = Path(run_dir) / records.ERROR_LOG
    if old.is_file():
        os.replace(old, old.with_name(f"{records.ERROR_LOG}.attempt{attempt - 1}"))


def _walk_points(sweep_dir: Path) -> Iterator[dict]:
    for root, dirs, files in os.walk(sweep_dir):
        if records.POINT in files:
            point = records.read_json(Path(root) / records.POINT)
            if point is not None:
                yield point
            dirs[:] = []  # a run dir holds no other run
            continue
        dirs[:] = [d for d in dirs if d not in records.RUN_INTERNALS]


def _key(p: Mapping[str, Any]) -> tuple:
    return ("num", p["num"]) if p.get("num") is not None else ("dir", p.get("run_dir"))


def record_refused(sweep_dir: str | Path, num: Optional[int], overrides: list, error: str) -> dict:
    """A point refused before it claimed its run dir (kdexp.track.claim): named in sweep.json's ``refused`` list,
    never in that run dir, which holds another run or nothing. Returns the rebuilt sweep.json."""
    sweep_dir = Path(sweep_dir).resolve()
    with records.locked(sweep_dir / ".sweep.lock"):
        sweep = records.read_json(sweep_dir / records.SWEEP) or {"sweep_dir": str(sweep_dir), "points": []}
        entry = {"num": num, "overrides": list(overrides), "error": error, "at": records.now(),
                 "name": run_name(list(overrides), sweep.get("keys"))}
        sweep["refused"] = [r for r in sweep.get("refused", []) if r.get("num") != num or num is None] + [entry]
        records.write_json(sweep_dir / records.SWEEP, sweep)
    return rebuild_sweep(sweep_dir)


def rebuild_sweep(sweep_dir: str | Path) -> dict:
    """sweep.json from the entries already there (the plan: pending points) and every point.json below sweep_dir.
    A refused point (``refused``) is no pending point of the plan; a point.json of its num on disk is another run's
    record and stays as it is."""
    sweep_dir = Path(sweep_dir).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    # each job writes its point.json before taking the lock, so the last one to take it sees every point
    with records.locked(sweep_dir / ".sweep.lock"):
        old = records.read_json(sweep_dir / records.SWEEP) or {}
        refused = old.get("refused") or []
        by_key: dict = {_key(p): p for p in old.get("points", [])
                        if not (p.get("run_dir") is None and any(r.get("num") == p.get("num") for r in refused))}
        for p in _walk_points(sweep_dir):
            by_key.pop(("dir", p.get("run_dir")), None)
            plan = by_key.get(_key(p), {})
            if plan.get("overrides") not in (None, p.get("overrides")):
                plan = {}  # the plan of a later command whose point was refused: its name is not this run's
            by_key[_key(p)] = {**plan, **p}  # keeps the plan's fields (name) under the point's
        # a point recorded pending/running whose process is gone is "interrupted" (records.liveness)
        for key, p in by_key.items():
            by_key[key] = {**p, "status": records.liveness(p, sweep_dir)}
        points = sorted(by_key.values(), key=lambda p: (p.get("num") is None, p.get("num") or 0, p.get("run_dir")))
        counts = {s: sum(p.get("status") == s for p in points) for s in records.STATUSES}
        sweep = {"sweep_dir": str(sweep_dir), "total": old.get("total", len(points)) or len(points),
                 "counts": counts, "updated": records.now(), "points": points, "refused": refused,
                 "keys": old.get("keys"), "launcher": old.get("launcher")}
        records.write_json(sweep_dir / records.SWEEP, sweep)
    return sweep


def report_command(sweep_dir: str | Path) -> str:
    return f"python -m kdexp.report {sweep_dir}"


def dashboard_path(sweep_dir: str | Path) -> Path:
    """The sweep's live dashboard (kdexp.report.live keeps it current while the sweep runs)."""
    return Path(sweep_dir) / "report" / "index.html"


def progress_line(sweep: Mapping[str, Any], dashboard: bool = False) -> str:
    """``dashboard``: the sweep keeps its report current, so the line points at it instead of a command that builds
    it."""
    c = sweep["counts"]
    total = max(sweep.get("total") or 0, len(sweep["points"]))
    where = f"dashboard: {dashboard_path(sweep['sweep_dir'])}" if dashboard else \
        f"report: {report_command(sweep['sweep_dir'])}"
    return (f"[sweep] {c['finished'] + c['reused']}/{total} done, {c['running']} running, {c['failed']} failed,"
            f" {c['diverged']} diverged - {where}")


def wandb_sync_line(sweep_dir: str | Path) -> Optional[str]:
    """One ``wandb sync`` command for every point's offline W&B run (None when no point logged offline)."""
    if not any(Path(sweep_dir).glob("*/wandb/offline-run-*")):
        return None
    return f"wandb sync {Path(sweep_dir)}/*/wandb/offline-run-*"


def end_lines(sweep: Mapping[str, Any], dashboard: bool = False) -> list[str]:
    """The sweep's last words: the counts, one line per failed, diverged, interrupted or refused point (a failed or
    diverged one naming its error.log), then where
    the report is (``dashboard``: the sweep built it, so its path; else the command that builds it) and the one
    command that uploads the sweep's offline W&B runs."""
    c = sweep["counts"]
    lines = [f"[sweep] ended: {c['finished']} finished, {c['reused']} reused, {c['failed']} failed,"
             f" {c['diverged']} diverged, {c['running'] + c['pending']} not finished"
             + (f", {c['interrupted']} interrupted" if c.get("interrupted") else "")
             + (f", {len(sweep['refused'])} refused" if sweep.get("refused") else "") + f", of {sweep['total']}"
             f" - {Path(sweep['sweep_dir']) / records.SWEEP}"]
    for p in sweep["points"]:
        if p.get("status") in records.ENDED_BADLY:
            lines.append(f"[sweep] {p['status']} #{p.get('num')}: {p.get('name') or run_name(p.get('overrides') or [])}:"
                         f" {p.get('error')} (see {p.get('run_dir')}/{records.ERROR_LOG})")
    for p in sweep["points"]:
        if p.get("status") == "interrupted":
            lines.append(f"[sweep] interrupted #{p.get('num')}: {p.get('name') or run_name(p.get('overrides') or [])}:"
                         " its process is gone (killed, out of memory or preempted); rerun the sweep to resume it")
    for r in sweep.get("refused") or []:  # nothing of these points was written: their line is all there is
        lines.append(f"[sweep] refused #{r.get('num')}: {r.get('name')}: {r.get('error')}")
    html = dashboard_path(sweep["sweep_dir"])
    lines.append(f"[sweep] report: {html}" if dashboard and html.is_file() else
                 f"[sweep] report: {report_command(sweep['sweep_dir'])}")
    sync = wandb_sync_line(sweep["sweep_dir"])
    if sync is not None:
        lines.append(f"[sweep] upload to W&B: {sync}")
    return lines
