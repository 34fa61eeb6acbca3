"""A W&B group (one sweep's runs) -> the same ``Sweep`` of ``Point`` records the run-dir loader builds.

    wandb.Api().runs("entity/project", filters={"group": group})
      run.config    -> Point.config (the resolved config kdexp logs); swept keys = config keys that differ
      run.summary   -> Point.final (and its "cost" -> Point.cost)
      run.history() -> Point.curves (rows keyed by _step, NaN where a metric was not logged at that step)
      run.state     -> Point.status (finished / running / failed for failed, crashed, killed; diverged when the
                       summary has kdexp's diverged_step)
kdexp names a sweep's run by its swept overrides ('balancer.alpha=0.5,loss=topk'); when the name parses as
overrides (or the config carries an ``overrides`` list) those are the point's overrides, as for a run dir.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

from kdexp.report.cost import add_cost_metrics
from kdexp.report.model import Point, Sweep
from kdexp.report.params import build_sweep
from kdexp.track.records import parse_overrides

_STATES = {"finished": "finished", "running": "running", "pending": "pending", "preempting": "running",
           "preempted": "failed", "failed": "failed", "crashed": "failed", "killed": "failed"}
_OVERRIDE = re.compile(r"^[+~]*[A-Za-z_][\w.@/-]*=")
HISTORY_SAMPLES = 100_000  # W&B samples history down to this many rows


def _as_dict(obj: Any) -> dict:
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "_json_dict"):  # wandb's HTTPSummary
        return dict(obj._json_dict)
    if hasattr(obj, "keys"):
        return {k: obj[k] for k in obj.keys()}
    return dict(obj)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:  # numpy scalars from a DataFrame
            value = float(value)
        except (TypeError, ValueError):
            return None
    value = float(value)
    return value if math.isfinite(value) else None


def _history_rows(run: Any) -> Iterable[dict]:
    try:  # rows as dicts: no pandas needed at run time (a DataFrame, which other callers may hand in, works too)
        history = run.history(samples=HISTORY_SAMPLES, pandas=False)
    except TypeError:
        history = run.history()
    if hasattr(history, "to_dict"):  # pandas DataFrame
        return history.to_dict("records")
    return list(history or [])


def curves_from_history(rows: Iterable[dict]) -> dict[str, list[tuple[int, float]]]:
    by_metric: dict[str, dict[int, float]] = {}
    for row in rows:
        step = _number(row.get("_step", row.get("step")))
        if step is None:
            continue
        for key, value in row.items():
            if key.startswith("_") or key in ("step", "kind"):
                continue
            v = _number(value)
            if v is not None:
                by_metric.setdefault(key, {})[int(step)] = v
    return {k: sorted(v.items()) for k, v in by_metric.items()}


def _overrides(run: Any, config: dict) -> dict[str, str]:
    listed = config.get("overrides")
    if isinstance(listed, list) and all(isinstance(o, str) for o in listed):
        return parse_overrides(listed)
    name = getattr(run, "name", None) or ""
    parts = name.split(",") if name and name != "defaults" else []
    if parts and all(_OVERRIDE.match(p) for p in parts):
        return parse_overrides(parts)
    return {}


def point_from_run(run: Any) -> Point:
    """One W&B run (anything with .name, .state, .config, .summary, .history()) -> Point."""
    config = _as_dict(getattr(run, "config", None))
    config.pop("overrides", None)
    summary = _as_dict(getattr(run, "summary", None))
    curves = curves_from_history(_history_rows(run))
    state = str(getattr(run, "state", "") or "").lower()
    status = _STATES.get(state, "running")
    if _number(summary.get("diverged_step")) is not None:  # kdexp.train.point logs it when a run diverges
        status = "diverged"
    final = {k: v[-1][1] for k, v in curves.items() if v}
    final.update({k: n for k, v in summary.items() if not k.startswith("_") and (n := _number(v)) is not None})
    error = None
    if status == "failed":
        error = str(summary.get("error") or f"W&B run state: {state}")
    elif status == "diverged":
        error = f"diverged at step {int(summary['diverged_step'])}"
    steps = summary.get("_step")
    return Point(name=getattr(run, "name", None) or getattr(run, "id", "run"), run_dir=None,
                 overrides=_overrides(run, _as_dict(getattr(run, "config", None))), config=config, final=final,
                 curves=curves, status=status, error=error, final_partial=status != "finished" and bool(final),
                 steps=int(steps) if _number(steps) is not None else None,
                 cost=_as_dict(summary.get("cost")) if isinstance(summary.get("cost"), dict) else {},
                 reused_from=config.get("reused_from") or summary.get("reused_from") or None)


def load_wandb_group(group: str, *, project: str = "kdexp", entity: Optional[str] = None, api: Any = None) -> Sweep:
    """The runs of W&B group ``group`` in ``entity/project`` as a Sweep (``api`` defaults to wandb.Api())."""
    if not group:
        raise ValueError(f"group={group!r}: give the W&B group of the sweep (the sweep dir's name)")
    if api is None:
        import wandb

        api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    points = [point_from_run(run) for run in api.runs(path, filters={"group": group})]
    sweep = build_sweep(points, source=f"wandb:{path}/{group}")
    add_cost_metrics(sweep)  # summary["cost"], as summary.json holds it (kdexp.train.point logs both)
    return sweep
