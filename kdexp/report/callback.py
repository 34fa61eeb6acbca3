"""LiveSweepCallback: the sweep callback (kdexp.track.callback.SweepCallback) that also keeps the sweep's live
dashboard, SWEEP_DIR/report/index.html, current (kdexp.report.live). conf/config.yaml names it in hydra.callbacks.

track keeps the sweep's records and knows nothing of reports (this package sits above it and reads those records);
this subclass hands it the page. Importing it is cheap (the report's modules, matplotlib among them, load at the first
refresh), since Hydra instantiates the callback in every run, a single run too.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from kdexp.track.callback import SweepCallback


class LiveSweepCallback(SweepCallback):
    """SweepCallback with the live dashboard (``report=false`` turns it off). A report error is one line on stderr
    and never fails a point or the sweep."""

    live_page = True

    def refresh_report(self, sweep_dir: Path, live: Optional[bool] = None) -> None:
        try:
            from kdexp.report.live import refresh_quietly
        except Exception as exc:  # noqa: BLE001 - e.g. matplotlib missing on a node: the sweep still runs
            print(f"[sweep] report not updated ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
            return
        refresh_quietly(sweep_dir, live=live)


__all__ = ["LiveSweepCallback"]
