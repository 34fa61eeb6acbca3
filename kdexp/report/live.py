"""The live sweep dashboard: SWEEP_DIR/report/index.html regenerated while a sweep runs.

Two writers keep it current, both through ``refresh`` (one at a time, under a file lock in the report dir):
  - the sweep itself: kdexp.report.callback.LiveSweepCallback calls ``refresh_quietly`` when the sweep starts (every point
    pending), when each point starts and ends (on the job's rank 0: in-process, a submitit worker or a SLURM task) and, with
    ``live=False``, when the multirun ends; a report error is printed as one line and never fails the sweep;
  - ``python -m kdexp.report SWEEP_DIR --watch``: regenerates it whenever a point's files change (curves so far of
    running points too) and stops, leaving the final page, when no point is pending or running.
While a point is pending or running the page carries ``<meta http-equiv="refresh">`` (the browser reloads it);
the final page has none.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from kdexp.report.document import REFRESH_S, ReportFiles, write_report
from kdexp.report.rundirs import load_sweep
from kdexp.track import records

LOCK = ".report.lock"
WATCHED = (records.METRICS, records.SUMMARY, records.POINT, records.SWEEP, records.ERROR_LOG)


def refresh(sweep_dir: str | Path, out_dir: Optional[str | Path] = None,
            live: Optional[bool] = None) -> Optional[ReportFiles]:
    """Regenerate the report of ``sweep_dir`` now (default out: SWEEP_DIR/report). ``live``: None = refresh tag
    while a point is pending or running; False = the final page. None when the sweep has no point yet."""
    sweep_dir = Path(sweep_dir)
    out = Path(out_dir) if out_dir is not None else sweep_dir / "report"
    with records.locked(out / LOCK):  # one report writer at a time (submitit workers end together)
        sweep = load_sweep(sweep_dir)  # under the lock: the last writer reads the newest state
        if not sweep.points:
            return None
        return write_report(sweep, out, live=live)


def refresh_quietly(sweep_dir: str | Path, live: Optional[bool] = None) -> None:
    """``refresh`` for the sweep callback: any error becomes one line on stderr; the sweep goes on."""
    try:
        refresh(sweep_dir, live=live)
    except Exception as exc:  # noqa: BLE001 - a broken report must never fail a training point
        print(f"[sweep] report not updated ({type(exc).__name__}: {exc}); the sweep goes on", file=sys.stderr,
              flush=True)


def fingerprint(sweep_dir: str | Path) -> tuple:
    """(path, size, mtime) of every file the report reads: unchanged = nothing to redraw."""
    found = []
    for root, dirs, files in os.walk(sweep_dir):
        dirs[:] = sorted(d for d in dirs if d not in records.RUN_INTERNALS and d != "report" and not d.startswith("."))
        for name in sorted(files):
            if name in WATCHED:
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                found.append((os.path.join(root, name), st.st_size, st.st_mtime_ns))
    return tuple(found)


def watch(sweep_dir: str | Path, out_dir: Optional[str | Path] = None, interval: float = REFRESH_S,
          echo: Callable[[str], None] = print, max_polls: Optional[int] = None) -> Optional[ReportFiles]:
    """Keep the report current until the sweep has ended (no point pending or running), then write the final page
    (no refresh) and return its files. Polls every ``interval`` s; redraws only when a point's files changed.
    ``max_polls`` bounds the loop (tests); None = until the sweep ends."""
    last: Optional[tuple] = None
    polls = 0
    while True:
        polls += 1
        now = fingerprint(sweep_dir)
        if now != last:
            last = now
            files = refresh(sweep_dir, out_dir)
            if files is not None:
                echo(f"[watch] {time.strftime('%H:%M:%S')} {files.summary} -> {files.html}")
                if not files.live:  # every point ended: this was the final page
                    return files
        if max_polls is not None and polls >= max_polls:
            return None
        time.sleep(interval)


__all__ = ["refresh", "refresh_quietly", "watch", "fingerprint", "LOCK"]
