"""Run directories (one run, a sweep, nested sweeps) -> ``Point`` records, read through kdexp.track.records.

Reads files only (``.hydra/``, ``metrics.jsonl``, ``summary.json``, ``point.json``, ``error.log``, ``sweep.json``); it
never imports the training code, so a report can be made on a laptop from a sweep copied off a cluster.
``kdexp.report.wandb_source`` builds the same records from a W&B group.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from kdexp.report.cost import add_cost_metrics
from kdexp.report.model import Point, Sweep, is_number
from kdexp.report.params import build_sweep
from kdexp.report.trainings import count_once, merge_sweeps
from kdexp.track import records

# Directories that never hold a run of the sweep: a run's internals, and the report's own output.
SKIP_DIRS = records.RUN_INTERNALS | {"report"}
RUN_MARKERS = (records.METRICS, records.SUMMARY, records.POINT)


# PyYAML's safe loader on libyaml's parser where PyYAML was built with it (the same resolver and constructor as
# yaml.safe_load, about 8x faster): a live report reads every point's .hydra files at each refresh
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=_LOADER)
    except (OSError, yaml.YAMLError):
        return None


def _read_dict(path: Path) -> Optional[dict]:
    data = records.read_json(path)
    return data if isinstance(data, dict) else None


def _numbers(values: Optional[dict]) -> dict[str, float]:
    """The numeric entries of a metrics mapping, NaN and infinities included (a diverged run's are real values)."""
    return {k: float(v) for k, v in (values or {}).items() if is_number(v)}


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl -> {metric: [(step, value)]} sorted by step; a line cut by a kill is skipped; a step logged
    twice (a resumed run) keeps its last value; non-finite values are kept."""
    by_metric: dict[str, dict[int, float]] = {}
    for record in records.read_jsonl(path):
        try:
            step = int(record["step"])
        except (KeyError, TypeError, ValueError):
            continue
        for key, value in _numbers({k: v for k, v in record.items() if k not in ("step", "kind")}).items():
            by_metric.setdefault(key, {})[step] = value
    return {k: sorted(v.items()) for k, v in by_metric.items()}


def last_values(curves: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    return {k: v[-1][1] for k, v in curves.items() if v}


def _natural(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return (path / ".hydra").is_dir() or any((path / m).is_file() for m in RUN_MARKERS)


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every run dir at or below ``root`` (a dir with .hydra/, metrics.jsonl, summary.json or point.json); a run dir
    is not searched further, and report/, checkpoints/, wandb/ and hidden dirs are skipped."""
    found = []
    for dirpath, dirs, _files in os.walk(Path(root)):
        here = Path(dirpath)
        if is_run_dir(here):
            found.append(here)
            dirs[:] = []
            continue
        dirs[:] = sorted((d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")), key=_natural)
    return found


def _error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _status(summary: Optional[dict], point_json: dict, traceback: Optional[str], curves: dict) -> str:
    """summary.json decides when there is one (finished, reused = finished, diverged, failed); else a failure record
    (point.json status failed/diverged or an error.log) = that; metrics or a running point.json = running; else
    pending."""
    ended = records.ended_status(summary)
    if ended is not None:
        return "finished" if ended in records.ENDED_WELL else ended
    recorded = point_json.get("status")
    if recorded in records.ENDED_BADLY:
        return recorded
    if traceback is not None:
        return "failed"
    if recorded == "interrupted":
        return recorded
    status = "running" if recorded == "running" or curves else "pending"
    # a point recorded running whose process is gone (its pid here, or its heartbeat stale) is interrupted
    return records.liveness({**point_json, "status": status}) if point_json else status


def _config_hash(summary: Optional[dict], run_dir: Path, point_json: dict) -> Optional[str]:
    """What the run dir trained: summary.json's config_hash, else run.json's (written when the run started)."""
    for record in (summary, _read_dict(run_dir / records.RUN), point_json):
        value = (record or {}).get("config_hash")
        if isinstance(value, str) and value:
            return value
    return None


def load_point(run_dir: str | Path, root: Optional[str | Path] = None) -> Point:
    """One run dir -> Point (status: see _status)."""
    run_dir = Path(run_dir)
    hydra_dir = run_dir / ".hydra"
    config = _read_yaml(hydra_dir / "config.yaml") or {}
    hydra_cfg = (_read_yaml(hydra_dir / "hydra.yaml") or {}).get("hydra") or {}
    summary = _read_dict(run_dir / records.SUMMARY)
    point_json = _read_dict(run_dir / records.POINT) or {}
    # what the point is, from what it trained: its summary (written by the run itself as it ended), its point.json,
    # and only then .hydra/ (written when a run of the same config claims the dir: kdexp.track.claim)
    overrides_list = (summary or {}).get("overrides") or point_json.get("overrides") \
        or _read_yaml(hydra_dir / "overrides.yaml") or []
    choices = {k: str(v) for k, v in ((hydra_cfg.get("runtime") or {}).get("choices") or {}).items()
               if not records.is_hydra_key(str(k)) and v is not None}
    num = (hydra_cfg.get("job") or {}).get("num", point_json.get("num"))
    num = int(num) if isinstance(num, int) or (isinstance(num, str) and num.isdigit()) else None
    if root is not None and Path(root).resolve() != run_dir.resolve():
        name = Path(os.path.relpath(run_dir.resolve(), Path(root).resolve())).as_posix()
    else:
        name = run_dir.resolve().name

    curves = read_metrics(run_dir / records.METRICS)
    reused_from = (summary or {}).get("reused_from")
    if not curves and reused_from:  # a point reused before reused points kept their own copy of the curves
        curves = read_metrics(Path(reused_from) / records.METRICS)
    error_log = run_dir / records.ERROR_LOG
    traceback = error_log.read_text(errors="replace") if error_log.is_file() else None
    status = _status(summary, point_json, traceback, curves)
    error = None
    if status in records.ENDED_BADLY:
        error = (summary or {}).get("error") or point_json.get("error") or _error_line(traceback or "") \
            or f"{status} (no error recorded)"
    # A summary's final metrics stand over the last logged values (a diverged run's are its last finite ones).
    final = {**last_values(curves), **_numbers((summary or point_json).get("final" if summary else "metrics"))}
    return Point(name=name, run_dir=run_dir, overrides=records.parse_overrides(overrides_list), config=config,
                 choices=choices, final=final, curves=curves, status=status, error=error, traceback=traceback,
                 num=num, steps=(summary or {}).get("step" if status == "diverged" else "steps"),
                 wall_s=(summary or {}).get("wall_s"), cost=(summary or {}).get("cost") or {},
                 reused_from=reused_from, final_partial=status != "finished" and bool(final),
                 config_hash=_config_hash(summary, run_dir, point_json))


def _planned_points(root: Path, found: list[Point]) -> list[Point]:
    """Points sweep.json lists that have no run dir yet (pending, or lost), so the report shows the whole plan."""
    sweep = _read_dict(root / records.SWEEP)
    if sweep is None:
        return []
    have_dirs = {p.run_dir.resolve() for p in found if p.run_dir is not None}
    have_nums = {p.num for p in found if p.num is not None}
    extra = []
    for entry in sweep.get("points") or []:
        run_dir = entry.get("run_dir")
        if run_dir is not None:
            candidates = {Path(run_dir).resolve() if Path(run_dir).is_absolute() else (root / run_dir).resolve(),
                          (root / Path(run_dir).name).resolve()}
            if candidates & have_dirs:
                continue
        elif entry.get("num") in have_nums:
            continue
        status = records.liveness({**entry, "status": entry.get("status") or "pending"}, root)
        status = "finished" if status in records.ENDED_WELL else status
        extra.append(Point(name=entry.get("name") or (Path(run_dir).name if run_dir else f"#{entry.get('num')}"),
                           run_dir=None, overrides=records.parse_overrides(entry.get("overrides") or []), config={},
                           final=_numbers(entry.get("metrics")),
                           status=status if status in records.STATUSES else "pending",
                           error=entry.get("error"), num=entry.get("num")))
    return extra


def load_sweep(root: str | Path) -> Sweep:
    """A sweep dir (points found recursively, plus pending points from sweep.json), a folder of sweeps (merged when
    their common settings agree, else ValueError) or a single run dir -> Sweep, each training counted once
    (kdexp.report.trainings)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"sweep_dir={str(root)!r} is not a directory (expected a run dir or a Hydra sweep dir)")
    points = [load_point(d, root) for d in find_run_dirs(root)]
    points += _planned_points(root, points)
    merged = merge_sweeps(points, root)  # refuses sweeps whose common settings differ
    points, duplicates = count_once(points)
    sweep = build_sweep(points, source=str(root))
    sweep.merged, sweep.duplicates = merged, duplicates
    add_cost_metrics(sweep)  # after every point is known: cache builds are shared out over the sweep's points
    return sweep


def latest_sweep(*bases: str | Path) -> Path:
    """The most recent sweep (a dir holding sweep.json or multirun.yaml) under ``bases`` (default: multirun/ here
    or one level up, as seen from notebooks/)."""
    bases = bases or ("multirun", "../multirun")
    # multirun/<date>/<time-id>/sweep.json: a few levels deep, never into the points' checkpoints
    patterns = [f"{'*/' * depth}{name}" for depth in range(4) for name in (records.SWEEP, "multirun.yaml")]
    candidates = [p.parent for b in bases if Path(b).is_dir() for pattern in patterns for p in Path(b).glob(pattern)]
    if not candidates:
        raise FileNotFoundError(f"no sweep (sweep.json or multirun.yaml) under {', '.join(map(str, bases))}; "
                                "set KDEXP_SWEEP_DIR to a sweep dir")
    return max(candidates, key=lambda p: p.stat().st_mtime)
