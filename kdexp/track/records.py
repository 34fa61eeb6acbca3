"""The run and sweep record formats: file names, statuses, strict JSON, metrics lines, error logs, overrides.

Stdlib only (no Hydra, no torch), so a report can read a sweep copied onto a laptop without the training stack.

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
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

# file names inside a run (or sweep point) directory, and the sweep directory's index
SUMMARY = "summary.json"  # written last and atomically: the run ended (status finished, reused or diverged)
METRICS = "metrics.jsonl"
POINT = "point.json"
HEARTBEAT = "heartbeat"  # its mtime is the last sign of life of a running point (or, in a sweep dir, of its launcher)
RUN = "run.json"  # {"config_hash"}: written when a run starts in a dir, the identity of the run that dir holds
SWEEP = "sweep.json"
RUN_LOG = "run.log"
ERROR_LOG = "error.log"

# pending/running: not ended; finished/reused: ended well; failed: an exception; diverged: a non-finite loss or
# gradient norm stopped it (its last finite checkpoint is kept); interrupted: recorded pending or running, but the
# process that would end it is gone (``liveness``): killed, preempted and not yet requeued, or its sweep was stopped
STATUSES = ("pending", "running", "finished", "reused", "failed", "diverged", "interrupted")
ENDED_WELL = ("finished", "reused")
ENDED_BADLY = ("failed", "diverged")  # a sweep with such a point exits with status 1

# Directories inside a run dir that never hold another run (Hydra's files, submitit logs, checkpoints, W&B): whoever
# walks a sweep for its points does not descend into them.
RUN_INTERNALS = frozenset({".hydra", ".submitit", "checkpoints", "wandb", "__pycache__"})

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


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a JSON-lines file (metrics.jsonl), decoded; a line cut by a kill (or not an object) is skipped,
    a missing file is empty."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for line in lines:
        try:
            record = loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def missing_steps(lines: Iterable[dict], upto: int, *, log_interval: int, eval_interval: int,
                  max_steps: int) -> dict[str, list[int]]:
    """The steps up to ``upto`` whose metrics.jsonl line is not among ``lines``, by kind ("train", "val"): a run
    logs its train line every log_interval steps and evaluates every eval_interval steps, and both at max_steps."""
    have: dict[str, set] = {"train": set(), "val": set()}
    for r in lines:
        if r.get("kind") in have and isinstance(r.get("step"), int):
            have[r["kind"]].add(r["step"])
    out = {}
    for kind, every in (("train", log_interval), ("val", eval_interval)):
        want = [s for s in range(1, upto + 1) if s % every == 0 or s == max_steps]
        out[kind] = [s for s in want if s not in have[kind]]
    return out


def spans(steps: list[int]) -> str:
    """[2, 3, 4, 9] -> '2-4, 9'."""
    out: list[str] = []
    for s in steps:
        if out and s == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def gap_line(missing: dict[str, list[int]]) -> Optional[str]:
    """'the train lines of steps 12-25 and the val lines of steps 15, 20' for what missing_steps found, else None."""
    parts = [f"the {kind} lines of steps {spans(steps)}" for kind, steps in missing.items() if steps]
    return " and ".join(parts) or None


def ended_status(summary: Optional[dict]) -> Optional[str]:
    """How the run whose summary.json this is ended: finished, reused (a finished earlier point's summary), diverged
    or failed; None without a summary (the run has not ended, or it died without one)."""
    if summary is None:
        return None
    status = summary.get("status", "finished")  # summaries written before statuses existed were all finished
    if status == "finished" and summary.get("reused_from"):
        return "reused"
    return status if status in STATUSES else "failed"


# ---------------------------------------------------------------------------------------------------------------------
# overrides as Hydra records them (.hydra/overrides.yaml, point.json, summary.json)
def override_key(override: str) -> str:
    """'loss.top_p=0.9' -> 'loss.top_p'; '+a.b=1' -> 'a.b'; '~x' -> 'x'; 'loss@x=topk' -> 'loss@x'."""
    return str(override).split("=", 1)[0].lstrip("+~")


def is_hydra_key(key: str) -> bool:
    """hydra.* keys and hydra/ groups: how a run was launched, not what it ran."""
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def parse_overrides(lines: Iterable[str]) -> dict[str, Optional[str]]:
    """['+a.b=1', 'loss=top_p', 'hydra.sweep.dir=x', '~c'] -> {'a.b': '1', 'loss': 'top_p', 'c': None}."""
    out: dict[str, Optional[str]] = {}
    for line in lines:
        key = override_key(line)
        if is_hydra_key(key):
            continue
        _, sep, value = str(line).partition("=")
        # Hydra writes an interpolation typed as ${a} into overrides.yaml as $\{a\}: show it as typed.
        out[key] = value.replace("\\{", "{").replace("\\}", "}") if sep else None
    return out


def parse_scalar(text: Optional[str]) -> Any:
    """An override value as Hydra types it: int, float, bool, null, else the string (quotes removed)."""
    if text is None:
        return None
    t = text.strip()
    low = t.lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    return t


# ---------------------------------------------------------------------------------------------------------------------
def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def write_error(run_dir: str | os.PathLike, what: str, error_text: str, replace: bool = True) -> bool:
    """The error of a run or point: error.log and appended to run.log, with time and host. With replace=False an
    error.log already there (the run wrote its own, with more context) is kept and nothing is written. Returns
    whether it wrote."""
    run_dir = Path(run_dir)
    if not replace and (run_dir / ERROR_LOG).is_file():
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    head = f"[{now()}] {what} on {socket.gethostname()}\n"
    (run_dir / ERROR_LOG).write_text(head + error_text)
    with open(run_dir / RUN_LOG, "a") as f:
        f.write(head + error_text + ("" if error_text.endswith("\n") else "\n"))
    return True


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on the file `path` (created) while the block runs: the sweep's writers (sweep.json
    rebuilds, the live report) take turns. No lock where flock is missing (a non-POSIX or network filesystem)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl

        f = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


# ----------------------------------------------------------------------------------------------------------------------
# is the process behind a "running" (or "pending") record still there?
#
# A heartbeat file, not only a pid: the report and the next sweep look from another host than the SLURM node that
# ran the point, where a pid means nothing, and squeue needs SLURM (a sweep copied to a laptop has none). The file's
# mtime is set on the shared filesystem the sweep dir lives on, so any host that sees the dir sees the beat; a beat
# every HEARTBEAT_S and a verdict only after STALE_S (10 beats missed) leaves ample room for clock skew and a slow
# filesystem. On the host that wrote the record, a pid that no longer exists says the same at once.

HEARTBEAT_S = 30.0
STALE_S = 300.0


def beat(directory: str | os.PathLike) -> None:
    """Touch ``directory``/heartbeat (a sign of life; errors are ignored: a full disk must not stop training)."""
    path = Path(directory) / HEARTBEAT
    try:
        path.touch()
    except OSError:
        pass


def _stale(directory: str | os.PathLike, now: float) -> Optional[bool]:
    """True when the heartbeat is older than STALE_S, False when fresh, None when there is none."""
    try:
        return now - (Path(directory) / HEARTBEAT).stat().st_mtime > STALE_S
    except OSError:
        return None


def _pid_gone(point: dict) -> bool:
    """The record's process is known to be gone: same host, and no process with its pid."""
    pid = point.get("pid")
    if not isinstance(pid, int) or point.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: a process of another user holds the pid: alive as far as we can tell
        return False
    return False


def liveness(point: dict, sweep_dir: Optional[str | os.PathLike] = None, now: Optional[float] = None) -> str:
    """The status of a point record as it stands now: "interrupted" for a "running" or "pending" point whose own
    process is gone (a worker recorded its pid: gone on this host, or its heartbeat stale; a point waiting for a
    local slot is such a pending point), and for a "pending" point of the plan whose launching process is gone (the
    sweep dir's heartbeat stale, or the launcher's pid gone on this host, and the point never started); else the
    recorded status."""
    status = point.get("status")
    now = time.time() if now is None else now
    if status not in ("running", "pending"):
        return status
    if _pid_gone(point):
        return "interrupted"
    run_dir = point.get("run_dir")
    if run_dir and (point.get("pid") is not None or status == "running"):
        return "interrupted" if _stale(run_dir, now) else status
    if status == "pending" and sweep_dir is not None:
        launcher = read_json(Path(sweep_dir) / SWEEP) or {}
        if _stale(sweep_dir, now) or _pid_gone(launcher.get("launcher") or {}):
            return "interrupted"
    return status


class Heartbeat:
    """A daemon thread that beats ``directory``/heartbeat every HEARTBEAT_S until ``stop()`` or the process ends."""

    def __init__(self, directory: str | os.PathLike, interval: float = HEARTBEAT_S) -> None:
        self.directory, self.interval = Path(directory), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kdexp-heartbeat:{self.directory}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            beat(self.directory)

    def start(self) -> "Heartbeat":
        beat(self.directory)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
