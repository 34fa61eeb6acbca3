"""SweepCallback: the Hydra callback (``hydra.callbacks``) that keeps a multirun's point.json and sweep.json current.

  - on_multirun_start (the submitting process): plans the points (basic sweeper), writes sweep.json with every point
    ``pending`` and prints the count, the sweep dir and the report command;
  - on_job_start / on_job_end (the job's process: basic launcher in-process, submitit on the worker; only global
    rank 0 writes): point.json ``running`` then ``finished`` / ``reused`` / ``failed`` / ``diverged``, sweep.json
    rebuilt from all point.json files, and a progress line. For a task that claims its run dir (kdexp.run.main,
    kdexp.track.claim) "running" is written once the claim is made, and a job that ended without it was refused:
    its one line goes into sweep.json's ``refused`` list and nothing into its run dir;
  - on_multirun_end (the submitting process): the final sweep.json, a summary line, and exit status 1 when a point
    failed, diverged, was interrupted (its worker died: hydra_plugins.kdexp_launcher) or was refused (``fail_exit``).

The live dashboard, <sweep>/report/index.html, is regenerated when the sweep starts, when each point starts and ends
(rank 0 of the job) and, final and without its refresh tag, when the multirun ends: through ``refresh_report``, which
does nothing here. kdexp.report sits above this package (it reads these records), so the page is drawn by a subclass
there, kdexp.report.callback.LiveSweepCallback, the callback conf/config.yaml names; ``report=false`` turns it off.

A point that raised is "diverged" when its summary.json says so (kdexp.train.point writes it when a non-finite loss
or gradient norm stopped the run), else "failed". How Hydra handles a failing job, and why this acts in on_job_end:
kdexp.track.hydra_adapter.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Mapping, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from kdexp.distributed.launch import global_rank
from kdexp.track import claim, faults, records
from kdexp.track.hydra_adapter import is_multirun, job_exception, job_value, keep_going_past, plan_points
from kdexp.track.naming import run_name, sweep_keys
from kdexp.track.points import (end_lines, progress_line, rebuild_sweep, record_failure, record_point, record_refused,
                                report_command, set_aside_error_log, slurm_job_id)
from kdexp.track.rundir import sweep_dir as hydra_sweep_dir


# directory -> records.Heartbeat: the sweep's (submitting process) and a point's (job process). In the module, not on
# the callback: submitit pickles the callback (with the launcher) to its workers, and a thread does not pickle.
_BEATS: dict = {}
_CLAIMING: set = set()  # run dirs of the jobs of this process whose task claims its run dir (kdexp.track.claim)


class SweepCallback(Callback):
    """Hydra callback keeping sweep.json current; see the module docstring.

    keep_going: a failing point is recorded and the sweep goes on (else Hydra stops after the batch).
    fail_exit: at the end of a multirun with failed or diverged points, exit with status 1 (after sweep.json is
    written).
    report: keep the live dashboard current, where the class draws one (``live_page``; the progress lines then name
    it).
    """

    live_page = False  # True in a subclass whose refresh_report draws the dashboard

    def __init__(self, keep_going: bool = True, fail_exit: bool = True, report: bool = True) -> None:
        self.keep_going = keep_going
        self.fail_exit = fail_exit
        self.report = report and self.live_page

    @staticmethod
    def _beat(directory: Path, on: bool) -> None:
        """Start or stop the heartbeat that tells a later look (records.liveness) this process is still there."""
        if on and directory not in _BEATS:
            _BEATS[directory] = records.Heartbeat(directory).start()
        elif not on and directory in _BEATS:
            _BEATS.pop(directory).stop()

    def refresh_report(self, sweep_dir: Path, live: Optional[bool] = None) -> None:
        """Regenerate the sweep's live dashboard (``live``: None = refresh tag while a point is pending or running,
        False = the final page). None here: kdexp.report.callback.LiveSweepCallback draws it."""

    def _refresh_report(self, sweep_dir: Path, live: Optional[bool] = None) -> None:
        if self.report:
            self.refresh_report(sweep_dir, live=live)

    # submitting process -------------------------------------------------------------------------------------------
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if global_rank() != 0:  # e.g. a multirun started under torchrun: every rank runs Hydra
            return
        sweep_dir = hydra_sweep_dir(config.hydra)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self._beat(sweep_dir, True)  # the pending points have a launcher until on_multirun_end
        planned = plan_points(config.hydra)
        if planned is not None:
            keys = sweep_keys(planned)
            points = [{"num": i, "overrides": o, "name": run_name(o, keys), "run_dir": None, "status": "pending",
                       "metrics": {}, "error": None} for i, o in enumerate(planned)]
            records.write_json(sweep_dir / records.SWEEP,  # a new plan: the refusals of an earlier launch go
                               {"sweep_dir": str(sweep_dir), "total": len(points), "points": points, "keys": keys,
                                "launcher": {"pid": os.getpid(), "host": socket.gethostname()}})
        rebuild_sweep(sweep_dir)
        n = f"{len(planned)} points" if planned is not None else "an unknown number of points"
        print(f"[sweep] {n} -> {sweep_dir}\n[sweep] report: {report_command(sweep_dir)}"
              f" (progress in {sweep_dir / records.SWEEP})", flush=True)
        if planned is not None:
            self._refresh_report(sweep_dir)
            if self.report:
                print(f"[sweep] live dashboard: {sweep_dir / 'report' / 'index.html'}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if global_rank() != 0:
            return
        sweep = rebuild_sweep(hydra_sweep_dir(config.hydra))
        self._beat(hydra_sweep_dir(config.hydra), False)
        self._refresh_report(hydra_sweep_dir(config.hydra), live=False)
        print("\n".join(end_lines(sweep, dashboard=self.report)), flush=True)
        if self.fail_exit and (any(sweep["counts"][s] for s in (*records.ENDED_BADLY, "interrupted"))
                               or sweep.get("refused")):
            raise SystemExit(1)  # not an Exception: Hydra's callback wrapper would turn that into a warning

    # job process ----------------------------------------------------------------------------------------------------
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_multirun(config.hydra) or global_rank() != 0:
            return
        run_dir = Path(config.hydra.runtime.output_dir)
        if claim.claims(kwargs.get("task_function")):
            # nothing goes into the run dir before the task has claimed it (kdexp.track.claim): a point refused
            # there leaves that dir as it was
            _CLAIMING.add(run_dir)
            claim.after_claim(run_dir, lambda: self._start_point(config, run_dir))
        else:
            self._start_point(config, run_dir)

    def _start_point(self, config: DictConfig, run_dir: Path) -> None:
        previous = records.read_json(run_dir / records.POINT) or {}
        # A point.json already there means SLURM requeued this point (timeout/preemption) into the same run dir.
        attempt = int(previous.get("attempt", 0)) + 1
        if attempt > 1:
            set_aside_error_log(run_dir, attempt)
        self._beat(run_dir, True)
        record_point(run_dir, "running", metrics={}, attempt=attempt, started=records.now(),
                     host=socket.gethostname(), pid=os.getpid(), slurm_job_id=slurm_job_id())
        rebuild_sweep(hydra_sweep_dir(config.hydra))
        self._refresh_report(hydra_sweep_dir(config.hydra))  # the dashboard shows this point running

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not is_multirun(config.hydra):
            return
        run_dir = Path(config.hydra.runtime.output_dir)
        exc = job_exception(job_return)
        if run_dir in _CLAIMING and not claim.is_claimed(run_dir):
            _CLAIMING.discard(run_dir)
            return self._refused(config, job_return, exc)
        line = faults.one_line(exc)  # a full disk, a value its setup refuses: the single run's one line, no traceback
        if line is not None and global_rank() == 0:
            print(f"kdexp: error: {line}", file=sys.stderr, flush=True)
        elif exc is not None and line is None:  # every rank: the traceback goes to this task's log (submitit: one
            sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))  # per task)
        point = None
        try:
            point = self._record_end(config, job_return, exc) if global_rank() == 0 else None
        except OSError as err:  # sweep.json on a full disk: say so in one line and let the other points go on
            told = faults.one_line(err)
            if told is None:
                raise
            print(f"kdexp: error: {told} (the sweep's records of this point)", file=sys.stderr, flush=True)
        self._beat(run_dir, False)
        if run_dir in _CLAIMING:
            _CLAIMING.discard(run_dir)
            claim.release(run_dir)  # its records are written: the next claim of this dir may go ahead
        if exc is not None and self.keep_going:
            status = (point or {}).get("status", "failed")
            keep_going_past(job_return, {"status": status, "error": line or f"{type(exc).__name__}: {exc}"})

    def _refused(self, config: DictConfig, job_return: Any, exc: Optional[BaseException]) -> None:
        """A point refused before it claimed its run dir: its one line, named in sweep.json, nothing in that dir."""
        line = str(exc) if exc is not None else "refused before it claimed its run dir"
        if global_rank() == 0:
            print(f"kdexp: error: {line}", file=sys.stderr, flush=True)
            run_dir = Path(config.hydra.runtime.output_dir)
            claim.refused(run_dir)
            num = OmegaConf.select(config, "hydra.job.num")
            sweep = record_refused(hydra_sweep_dir(config.hydra), num, list(config.hydra.overrides.task), line)
            print(progress_line(sweep, dashboard=self.report), flush=True)
        if exc is not None and self.keep_going:
            keep_going_past(job_return, {"status": "refused", "error": line})

    def _record_end(self, config: DictConfig, job_return: Any, exc: Optional[BaseException]) -> Optional[dict]:
        run_dir = Path(config.hydra.runtime.output_dir)
        previous = records.read_json(run_dir / records.POINT) or {}
        if exc is not None:
            point = record_failure(run_dir, exc)
        elif previous.get("status") in records.ENDED_BADLY:
            point = previous  # the task caught its exception and recorded it itself: keep that record
        else:
            summary = records.read_json(run_dir / records.SUMMARY)
            if summary is not None:
                status = records.ended_status(summary)
                metrics = summary.get("final") or {}
            else:
                value = job_value(job_return)
                status = "finished"
                metrics = {k: v for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)} \
                    if isinstance(value, Mapping) else {}
            point = record_point(run_dir, status, metrics=metrics, ended=records.now(),
                                 error=summary.get("error") if status in records.ENDED_BADLY else None)
        print(progress_line(rebuild_sweep(hydra_sweep_dir(config.hydra)), dashboard=self.report), flush=True)
        self._refresh_report(hydra_sweep_dir(config.hydra))
        return point
