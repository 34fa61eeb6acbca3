"""The run and sweep record formats: file names, statuses, strict JSON, metrics lines, error logs. Stdlib only.

kdexp.track writes these files and kdexp.report reads them, both through this module, so the format is defined once.

Strict JSON: Python's json writes NaN/Infinity as bare tokens that other readers (jq, browsers, W&B) reject. A
non-finite float is stored as the string "NaN", "Infinity" or "-Infinity" and read back as a float, so a diverged
run's metrics round-trip and a report can show NaN as NaN (not as a missing value).
"""
from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# file names inside a run (or sweep point) directory, and the sweep directory's index
SUMMARY = "summary.json"  # written last and atomically: the run ended (status finished, reused or diverged)
METRICS = "metrics.jsonl"
POINT = "point.json"
SWEEP = "sweep.json"
RUN_LOG = "run.log"
ERROR_LOG = "error.log"

# pending/running: not ended; finished/reused: ended well; failed: an exception; diverged: a non-finite loss or
# gradient norm stopped it (its last finite checkpoint is kept)
STATUSES = ("pending", "running", "finished", "reused", "failed", "diverged")
ENDED_WELL = ("finished", "reused")

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _default(value: Any) -> Any:
    """Tensors, numpy scalars and paths: as a float when they are numbers, else as their string."""
    try:
        return _encode(float(value))
    except (TypeError, ValueError):
        return str(value)


def dumps(data: Any, **kwargs: Any) -> str:
    """Strict JSON (allow_nan=False) with non-finite floats as strings."""
    return json.dumps(_encode(data), allow_nan=False, default=_default, **kwargs)


def loads(text: str) -> Any:
    return _decode(json.loads(text))


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write strict JSON atomically: a temp file in the same directory, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | os.PathLike) -> Optional[Any]:
    """The decoded file, or None when it is missing or not JSON (a torn or foreign file is not a record)."""
    try:
        return loads(Path(path).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def write_error(run_dir: str | os.PathLike, what: str, error_text: str) -> None:
    """The error of a run or point: error.log (replaced) and appended to run.log, with time and host."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    head = f"[{now()}] {what} on {socket.gethostname()}\n"
    (run_dir / ERROR_LOG).write_text(head + error_text)
    with open(run_dir / RUN_LOG, "a") as f:
        f.write(head + error_text + ("" if error_text.endswith("\n") else "\n"))
