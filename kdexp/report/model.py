"""The records every table and plot reads: ``Point`` (one run) and ``Sweep`` (the points with what varies), and how a
metric is taken over several points.

Non-finite metrics are values, not gaps: a diverged run's NaN stays NaN (shown as "NaN"; "—" means missing). A mean
over replicates that include a non-finite value is NaN, and says how many of its values were non-finite.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from kdexp.track.records import STATUSES

MISSING = object()  # a key a config does not have (None is a value a config can hold)


def short(value: Any) -> str:
    """A number in a few characters (seeds, metric values in prose). Swept values are shown with ``typed``."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def typed(value: Any) -> str:
    """A resolved swept value as Python/YAML writes it, so a float stays a float: 1.0 -> '1.0' (not '1'), 1e-05."""
    if isinstance(value, float):
        return repr(value)
    if value is None:
        return "null"
    return str(value)


def is_number(value: Any) -> bool:
    """int or float, finite or not; booleans are categories."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


@dataclass
class Point:
    """One run: what it was asked to do, what it reported, and how it ended."""

    name: str  # the run dir relative to the sweep root (the dir's name for a single run), or the W&B run name
    run_dir: Optional[Path]
    overrides: dict[str, Optional[str]]  # override key ("+"/"~" stripped) -> value as typed; no hydra keys
    config: dict  # the composed config (.hydra/config.yaml, interpolations kept) or the W&B config
    choices: dict[str, str] = field(default_factory=dict)  # config group -> option (hydra.runtime.choices)
    final: dict[str, float] = field(default_factory=dict)  # final metrics (NaN/inf kept)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> [(step, value)], by step
    status: str = "pending"  # one of records.STATUSES except "reused" (a reused point is finished, reused_from set)
    error: Optional[str] = None  # one line, for failed and diverged points
    traceback: Optional[str] = None  # error.log, when there is one
    num: Optional[int] = None  # Hydra job number in the sweep
    steps: Optional[int] = None  # the steps a finished run ran; the step a diverged run stopped at
    wall_s: Optional[float] = None
    reused_from: Optional[str] = None  # a finished point of an earlier sweep with the same resolved config
    final_partial: bool = False  # final holds the last logged values of a run that did not finish
    params: dict[str, Any] = field(default_factory=dict)  # swept key -> resolved value (set by build_sweep)
    arm: Optional[str] = None  # the experiment arm (set by build_sweep when the config names one)
    seed: Any = None  # trainer.seed as resolved (set by build_sweep): replicates of a configuration pair by it
    shown: dict[str, str] = field(default_factory=dict)  # swept key -> its value as typed (set by build_sweep)
    cost: dict[str, Any] = field(default_factory=dict)  # what the point cost (summary.json "cost", kdexp.track.cost)
    config_hash: Optional[str] = None  # what it trained (kdexp.config.config_hash; the seed is part of it)
    sweep: Optional[str] = None  # the sweep dir it belongs to, relative to the folder reported (kdexp.report.trainings)
    copies: list[str] = field(default_factory=list)  # other run dirs holding this same training (reused, superseded)

    def text(self, key: str) -> str:
        """The swept value as typed ('1.0' stays '1.0', '1e-3' stays '1e-3'); the one way every table, legend and
        label prints a swept value."""
        if key in self.shown:
            return self.shown[key]
        return typed(self.params.get(key))

    @property
    def label(self) -> str:
        """The point named by its swept values ('balancer.alpha=0.5, loss=topk'), else by its name."""
        if self.params:
            return ", ".join(f"{k}={self.text(k)}" for k in self.params)
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
    seed_key: Optional[str] = None  # the swept key that only picks a replicate (trainer.seed), when one is swept
    merged: list[str] = field(default_factory=list)  # the sweeps a folder of several merged (kdexp.report.trainings)
    duplicates: list[tuple[str, str, str]] = field(default_factory=list)  # (run dir, the point it is, why) folded
    one_time: list[Any] = field(default_factory=list)  # the one-time work its points used (kdexp.report.cost)

    @property
    def config_keys(self) -> list[str]:
        """The swept keys that make a configuration (every swept key but the seed)."""
        return [k for k in self.swept if k != self.seed_key]

    @property
    def live(self) -> bool:
        """True while a point is still pending or running (the dashboard refreshes itself)."""
        return any(p.status in ("pending", "running") for p in self.points)

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
        return bool(values) and all(is_number(v) for v in values)


def iter_values(points: Iterable[Point], metric: str) -> Iterator[tuple[Point, float]]:
    """(point, final value) for the points that have a finite final ``metric`` (candidates for a best point)."""
    for p in points:
        v = p.final.get(metric)
        if is_finite(v):
            yield p, float(v)


@dataclass(frozen=True)
class Aggregate:
    """A metric over replicates: the mean of ``n`` values, NaN when ``nonfinite`` of them are NaN or infinite."""

    mean: Optional[float]  # None: no point has the metric
    n: int
    nonfinite: int


def aggregate(points: Iterable[Point], metric: str) -> Aggregate:
    """The mean of ``metric`` over the points that have it. A non-finite value is not dropped: it makes the mean NaN
    (inf + -inf, or NaN, would anyway), and ``nonfinite`` counts such values so the table can say so."""
    values = [float(p.final[metric]) for p in points if is_number(p.final.get(metric))]
    if not values:
        return Aggregate(None, 0, 0)
    bad = sum(not math.isfinite(v) for v in values)
    return Aggregate(math.nan if bad else sum(values) / len(values), len(values), bad)
