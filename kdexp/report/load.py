"""Run directories (one run, a sweep, nested sweeps) -> ``Point`` records, the one shape every table and plot reads.

Reads files only (``.hydra/``, ``metrics.jsonl``, ``summary.json``, ``point.json``, ``error.log``, ``sweep.json``); it
never imports the training code, so a report can be made on a laptop from a sweep copied off a cluster.
``kdexp.report.wandb_source`` builds the same records from a W&B group.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import yaml

STATUSES = ("finished", "running", "pending", "failed")
# Directories that never hold a run of the sweep (the report's own output, a run's internals).
SKIP_DIRS = {"report", ".hydra", ".submitit", "checkpoints", "wandb", "__pycache__"}
RUN_MARKERS = ("metrics.jsonl", "summary.json", "point.json")
# Resolved-config keys that differ between points for bookkeeping reasons, not because of the experiment.
NOISE_PREFIXES = ("hydra", "paths", "logger", "_wandb")
ARM_KEYS = ("experiment_arm", "arm")


@dataclass
class Point:
    """One run: what it was asked to do, what it reported, and how it ended."""

    name: str  # the run dir relative to the sweep root (the dir's name for a single run), or the W&B run name
    run_dir: Optional[Path]
    overrides: dict[str, str]  # override key ("+"/"~" stripped) -> value as typed on the command line; no hydra.*
    config: dict  # the composed config (.hydra/config.yaml, interpolations kept) or the W&B config
    choices: dict[str, str] = field(default_factory=dict)  # config group -> option (hydra.runtime.choices)
    final: dict[str, float] = field(default_factory=dict)  # final metrics
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> [(step, value)], by step
    status: str = "pending"  # one of STATUSES
    error: Optional[str] = None  # one line, for failed points
    traceback: Optional[str] = None  # error.log, when there is one
    num: Optional[int] = None  # Hydra job number in the sweep
    steps: Optional[int] = None
    wall_s: Optional[float] = None
    reused_from: Optional[str] = None  # a finished point of an earlier sweep with the same resolved config
    final_partial: bool = False  # final holds the last logged values of a run that did not finish
    params: dict[str, Any] = field(default_factory=dict)  # swept key -> resolved value (set by build_sweep)
    arm: Optional[str] = None  # the experiment arm (set by build_sweep when the config names one)

    @property
    def label(self) -> str:
        """The point named by its swept values ('balancer.alpha=0.5, loss=topk'), else by its name."""
        if self.params:
            return ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return self.name


@dataclass
class Sweep:
    """The points of one sweep (or run) with what varies between them."""

    source: str  # the directory or W&B group the points were read from
    points: list[Point]
    swept: list[str]  # keys whose value differs between points (override keys, or config keys for W&B)
    fixed: dict[str, str]  # overrides every point shares
    arm_key: Optional[str] = None  # config key naming the experiment arm, when the points have one
    aliases: dict[str, list[str]] = field(default_factory=dict)  # swept key -> config keys that vary with it

    @property
    def finished(self) -> list[Point]:
        return [p for p in self.points if p.status == "finished"]

    @property
    def arms(self) -> list[str]:
        """Arm names in the order the points first use them."""
        return list(dict.fromkeys(p.arm for p in self.points if p.arm is not None))

    def counts(self) -> dict[str, int]:
        return {s: sum(p.status == s for p in self.points) for s in STATUSES}

    def is_numeric(self, key: str) -> bool:
        """True when every point's value for ``key`` is a number (booleans are categories)."""
        values = [p.params.get(key) for p in self.points if p.params.get(key) is not None]
        return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


# ---------------------------------------------------------------------------------------------------------------------
# small helpers
def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def parse_scalar(text: Optional[str]) -> Any:
    """An override value as Hydra types it: int, float, bool, null, else the string (quotes removed)."""
    if text is None:
        return None
    t = text.strip()
    low = t.lower()
    if low in ("null", "none", "~"):
        return None
    if low == "true":
        return True
    if low == "false":
        return False
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    return t


def parse_overrides(lines: Iterable[str]) -> dict[str, str]:
    """['+a.b=1', 'loss=top_p', 'hydra.sweep.dir=x', '~c'] -> {'a.b': '1', 'loss': 'top_p', 'c': None}."""
    out: dict[str, str] = {}
    for line in lines:
        key, sep, value = str(line).partition("=")
        key = key.lstrip("+~")
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        # Hydra writes an interpolation typed as ${a} into overrides.yaml as $\{a\}: show it as typed.
        out[key] = value.replace("\\{", "{").replace("\\}", "}") if sep else None
    return out


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}, 'c': [1, 2]} -> {'a.b': 1, 'c': [1, 2]}."""
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


_MISSING = object()


def lookup(config: dict, key: str) -> Any:
    """The value at dotted ``key`` with ${...} interpolations resolved where OmegaConf can; _MISSING if absent."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    if isinstance(node, str) and "${" in node:
        try:
            from omegaconf import OmegaConf

            resolved = OmegaConf.select(OmegaConf.create(config), key, throw_on_resolution_failure=True)
            node = OmegaConf.to_container(resolved, resolve=True) if OmegaConf.is_config(resolved) else resolved
        except Exception:  # noqa: BLE001 - a resolver only the training process knows (kdexp_stamp, env): keep text
            pass
    return node


def resolved_value(point: Point, key: str) -> Any:
    """What ``key`` was for this point: the group option, else the config value, else the override as typed."""
    if key in point.choices:
        return point.choices[key]
    value = lookup(point.config, key)
    if value is not _MISSING and not isinstance(value, (dict, list)):
        return value
    return parse_scalar(point.overrides.get(key))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl -> {metric: [(step, value)]} sorted by step; a line cut by a kill is skipped; a step logged
    twice (a resumed run) keeps its last value."""
    by_metric: dict[str, dict[int, float]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        for key, value in record.items():
            if key not in ("step", "kind") and _finite(value):
                by_metric.setdefault(key, {})[step] = float(value)
    return {k: sorted(v.items()) for k, v in by_metric.items()}


def last_values(curves: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    return {k: v[-1][1] for k, v in curves.items() if v}


def _natural(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


# ---------------------------------------------------------------------------------------------------------------------
# run directories
def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return (path / ".hydra").is_dir() or any((path / m).is_file() for m in RUN_MARKERS)


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every run dir at or below ``root`` (a dir with .hydra/, metrics.jsonl, summary.json or point.json); a run dir
    is not searched further, and report/, checkpoints/, wandb/ and hidden dirs are skipped."""
    root = Path(root)
    found = []
    for dirpath, dirs, _files in os.walk(root):
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


def load_point(run_dir: str | Path, root: Optional[str | Path] = None) -> Point:
    """One run dir -> Point. Status: summary.json = finished; a failure record (point.json status failed or an
    error.log) = failed; metrics or a running point.json = running; else pending."""
    run_dir = Path(run_dir)
    hydra_dir = run_dir / ".hydra"
    config = _read_yaml(hydra_dir / "config.yaml") or {}
    overrides_list = _read_yaml(hydra_dir / "overrides.yaml") or []
    hydra_cfg = (_read_yaml(hydra_dir / "hydra.yaml") or {}).get("hydra") or {}
    summary = _read_json(run_dir / "summary.json")
    point_json = _read_json(run_dir / "point.json") or {}
    if not overrides_list:
        overrides_list = point_json.get("overrides") or (summary or {}).get("overrides") or []
    choices = {k: str(v) for k, v in ((hydra_cfg.get("runtime") or {}).get("choices") or {}).items()
               if not str(k).startswith("hydra/") and v is not None}
    num = (hydra_cfg.get("job") or {}).get("num", point_json.get("num"))
    num = int(num) if isinstance(num, int) or (isinstance(num, str) and num.isdigit()) else None
    if root is not None and Path(root).resolve() != run_dir.resolve():
        name = Path(os.path.relpath(run_dir.resolve(), Path(root).resolve())).as_posix()
    else:
        name = run_dir.resolve().name

    curves = read_metrics(run_dir / "metrics.jsonl")
    reused_from = (summary or {}).get("reused_from")
    if not curves and reused_from:  # a reused point copies the summary only; its curves are in the earlier run
        curves = read_metrics(Path(reused_from) / "metrics.jsonl")

    error_log = run_dir / "error.log"
    traceback = error_log.read_text(errors="replace") if error_log.is_file() else None
    error = None
    final_partial = False
    if summary is not None and summary.get("status", "finished") in ("finished", "reused"):
        status = "finished"
        final = {**last_values(curves), **{k: float(v) for k, v in (summary.get("final") or {}).items()
                                           if _finite(v)}}
    else:
        recorded = point_json.get("status")
        if recorded == "failed" or traceback is not None or (summary or {}).get("status") == "failed":
            status = "failed"
            error = point_json.get("error") or (summary or {}).get("error") or _error_line(traceback or "") \
                or "failed (no error recorded)"
        elif recorded == "running" or curves:
            status = "running"
        else:
            status = "pending"
        final = {**last_values(curves), **{k: float(v) for k, v in (point_json.get("metrics") or {}).items()
                                           if _finite(v)}}
        final_partial = bool(final)
    return Point(name=name, run_dir=run_dir, overrides=parse_overrides(overrides_list), config=config,
                 choices=choices, final=final, curves=curves, status=status, error=error, traceback=traceback,
                 num=num, steps=(summary or {}).get("steps"),
                 wall_s=(summary or {}).get("wall_s"), reused_from=reused_from, final_partial=final_partial)


def _planned_points(root: Path, found: list[Point]) -> list[Point]:
    """Points sweep.json lists that have no run dir yet (pending, or lost), so the report shows the whole plan."""
    sweep = _read_json(root / "sweep.json")
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
        status = entry.get("status") or "pending"
        status = "finished" if status == "reused" else status
        metrics = {k: float(v) for k, v in (entry.get("metrics") or {}).items() if _finite(v)}
        extra.append(Point(name=entry.get("name") or (Path(run_dir).name if run_dir else f"#{entry.get('num')}"),
                           run_dir=None, overrides=parse_overrides(entry.get("overrides") or []), config={},
                           final=metrics, status=status if status in STATUSES else "pending",
                           error=entry.get("error"), num=entry.get("num")))
    return extra


def load_sweep(root: str | Path) -> Sweep:
    """A sweep dir (points found recursively, plus pending points from sweep.json) or a single run dir -> Sweep."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"sweep_dir={str(root)!r} is not a directory (expected a run dir or a Hydra sweep dir)")
    points = [load_point(d, root) for d in find_run_dirs(root)]
    points += _planned_points(root, points)
    return build_sweep(points, source=str(root))


def latest_sweep(*bases: str | Path) -> Path:
    """The most recent sweep (a dir holding sweep.json or multirun.yaml) under ``bases`` (default: multirun/ here
    or one level up, as seen from notebooks/)."""
    bases = bases or ("multirun", "../multirun")
    # multirun/<date>/<time-id>/sweep.json: a few levels deep, never into the points' checkpoints
    patterns = [f"{'*/' * depth}{name}" for depth in range(4) for name in ("sweep.json", "multirun.yaml")]
    candidates = [p.parent for b in bases if Path(b).is_dir() for pattern in patterns for p in Path(b).glob(pattern)]
    if not candidates:
        raise FileNotFoundError(f"no sweep (sweep.json or multirun.yaml) under {', '.join(map(str, bases))}; "
                                "set KDEXP_SWEEP_DIR to a sweep dir")
    return max(candidates, key=lambda p: p.stat().st_mtime)


# ---------------------------------------------------------------------------------------------------------------------
# what varies between points
def _differing_override_keys(points: list[Point]) -> tuple[list[str], dict[str, str]]:
    keys = list(dict.fromkeys(k for p in points for k in p.overrides))
    swept, fixed = [], {}
    for k in keys:
        values = {p.overrides.get(k, _MISSING) for p in points}
        if len(values) > 1:
            swept.append(k)
        else:
            fixed[k] = next(iter(values))
    return swept, fixed


def _signature(values: list[Any]) -> tuple:
    """How values split the points: equal signatures = the keys vary together."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(json.dumps(v, sort_keys=True, default=str), len(seen)) for v in values)


def config_differences(points: list[Point], exclude: Iterable[str] = ()) -> dict[str, list[Any]]:
    """Flattened config keys whose resolved value differs between points -> the value per point (None = absent)."""
    flat = [flatten(p.config) for p in points]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    skip = tuple(exclude)
    out = {}
    for k in keys:
        if k.split(".")[0] in NOISE_PREFIXES or k in skip:
            continue
        values = [lookup(p.config, k) if k in f else None for p, f in zip(points, flat)]
        values = [None if v is _MISSING else v for v in values]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            out[k] = values
    return out


def _arm_key(points: list[Point]) -> Optional[str]:
    for key in ARM_KEYS:
        if any(lookup(p.config, key) not in (_MISSING, None) for p in points):
            return key
    return None


def build_sweep(points: list[Point], source: str) -> Sweep:
    """Order the points, find what is swept and fill ``params`` and ``arm``. Swept keys are the override keys whose
    value differs between points; without overrides (W&B runs) they are the config keys that differ, and keys that
    vary together (an arm changes loss.* and balancer.* at once) are one parameter, the others kept as aliases."""
    # Job number order where there is one; otherwise the order given (directory order, W&B creation order).
    points = sorted(points, key=lambda p: (p.num is None, p.num if p.num is not None else 0))
    arm_key = _arm_key(points)
    aliases: dict[str, list[str]] = {}
    if any(p.overrides for p in points):
        swept, fixed = _differing_override_keys(points)
    else:
        fixed = {}
        diffs = config_differences(points)
        if arm_key in diffs:  # the arm names the group of keys it changes
            diffs = {arm_key: diffs.pop(arm_key), **diffs}
        by_signature: dict[tuple, str] = {}
        swept = []
        for key, values in diffs.items():
            sig = _signature(values)
            if sig in by_signature:
                aliases.setdefault(by_signature[sig], []).append(key)
            else:
                by_signature[sig] = key
                swept.append(key)
    for p in points:
        p.params = {k: resolved_value(p, k) for k in swept}
        if arm_key is not None:
            arm = lookup(p.config, arm_key)
            p.arm = None if arm in (_MISSING, None) else str(arm)
        elif "arm" in p.choices:
            p.arm = p.choices["arm"]
    if arm_key is None and any(p.arm is not None for p in points):
        arm_key = "arm"
    return Sweep(source=source, points=points, swept=swept, fixed={k: v for k, v in fixed.items() if v is not _MISSING},
                 arm_key=arm_key, aliases=aliases)


def iter_values(points: Iterable[Point], metric: str) -> Iterator[tuple[Point, float]]:
    """(point, final value) for the points that have a finite final ``metric``."""
    for p in points:
        v = p.final.get(metric)
        if _finite(v):
            yield p, float(v)
