"""Configurations: the points of a sweep that differ only in ``trainer.seed`` are replicates of one configuration.

A configuration's metric is a ``Summary`` (mean ± std, n, 95% Student-t interval) over its finished points; two
configurations are compared through a ``Difference`` paired by seed (the same seed means the same data order and
student init in both, so pairing removes that spread), or Welch's test when they share fewer than two seeds.

Timing metrics (perf/*) depend on the machine and its load while a point ran (other points, other users): they are
summarised but never ranked or compared.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

from kdexp.report.model import Point, Sweep, is_number, typed
from kdexp.report.ranges import clipped
from kdexp.report.stats import Difference, Summary, compare, summarize

TIMING_PREFIXES = ("perf/",)
# the cost/* metrics (kdexp.report.cost) that measure the machine too: device-hours and tokens/s
TIMING_KEYS = frozenset({"cost/total_device_hours", "cost/device_hours", "cost/one_time_device_hours",
                         "cost/tokens_per_s"})
MACHINE_NOTE = "machine-dependent"


def is_timing(metric: str) -> bool:
    """perf/* (tokens/s, step time) and the device-hours / tokens/s of cost/*: what the machine did under its load
    then, not what the configuration does."""
    return metric.startswith(TIMING_PREFIXES) or metric in TIMING_KEYS


def metric_label(metric: str) -> str:
    """The metric as headers and plot titles show it: timing metrics say they are machine-dependent."""
    return f"{metric} ({MACHINE_NOTE})" if is_timing(metric) else metric


@dataclass
class Configuration:
    """The replicates (points differing only in the seed) of one setting of the other swept keys."""

    params: dict[str, Any]  # swept key (seed excluded) -> resolved value
    points: list[Point] = field(default_factory=list)
    arm: Optional[str] = None

    def text(self, key: str) -> str:
        """A swept value as typed (its first point's text: every replicate has the same value)."""
        return self.points[0].text(key) if self.points else typed(self.params.get(key))

    @property
    def label(self) -> str:
        if self.params:
            return ", ".join(f"{k}={self.text(k)}" for k in self.params)
        return self.points[0].label if len(self.points) == 1 else "all points"

    @property
    def finished(self) -> list[Point]:
        return [p for p in self.points if p.status == "finished"]

    def status_text(self) -> str:
        counts: dict[str, int] = {}
        for p in self.points:
            counts[p.status] = counts.get(p.status, 0) + 1
        return ", ".join(f"{n} {s}" for s, n in counts.items())

    def values(self, metric: str) -> dict[Hashable, float]:
        """Finished points' final ``metric`` keyed by seed (a seed seen twice gets (seed, k); a point without a known
        seed its own key, so it pairs with nothing)."""
        out: dict[Hashable, float] = {}
        for p in self.finished:
            v = p.final.get(metric)
            if not is_number(v):
                continue
            key: Hashable = p.seed if p.seed is not None else ("point", p.name)
            k = 1
            while key in out:
                key, k = (p.seed, k), k + 1
            out[key] = float(v)
        return out

    def summary(self, metric: str) -> Summary:
        """Over the finished replicates, the interval clipped to the metric's range and withheld below
        MIN_INTERVAL_N (kdexp.report.ranges)."""
        return clipped(metric, summarize(self.values(metric).values()))


def configurations(sweep: Sweep) -> list[Configuration]:
    """The sweep's configurations in the order of their first point (every point its own one without a seed key)."""
    keys = sweep.config_keys
    groups: dict[Any, Configuration] = {}
    for i, p in enumerate(sweep.points):
        if sweep.seed_key is None:
            groups[("point", i)] = Configuration({k: p.params.get(k) for k in keys}, [p], p.arm)
            continue
        params = {k: p.params.get(k) for k in keys}
        ident = tuple(repr(params[k]) for k in keys) + (p.arm,)
        groups.setdefault(ident, Configuration(params, [], p.arm)).points.append(p)
    return list(groups.values())


def has_replicates(sweep: Sweep) -> bool:
    return sweep.seed_key is not None


# ---------------------------------------------------------------------------------------------------------------------
def better(goal: str, a: float, b: float) -> bool:
    return a < b if goal == "min" else a > b


@dataclass
class Ranking:
    """The best configuration for a metric, the runner-up, and whether the best is significantly better.
    When several configurations share the best mean exactly, ``ties`` holds them all: there is no best then (the
    report says "tie"), ``best`` is only the first of them and ``runner_up`` the next configuration below."""

    metric: str
    goal: str
    best: Configuration
    summary: Summary
    runner_up: Optional[Configuration] = None
    runner_up_summary: Optional[Summary] = None
    difference: Optional[Difference] = None  # best - runner-up (None on a tie)
    ties: list[Configuration] = field(default_factory=list)  # >= 2 configurations with the same best mean

    @property
    def tied(self) -> bool:
        return len(self.ties) > 1

    @property
    def significant(self) -> Optional[bool]:
        """True/False at 95%, None when it cannot be told (single runs, no runner-up, a tie, a non-finite value)."""
        if self.tied or self.difference is None or self.difference.significant is None:
            return None
        return self.difference.significant


def rank(configs: list[Configuration], metric: str, goal: Optional[str]) -> Optional[Ranking]:
    """The configuration with the best finite mean, and how it compares with the runner-up; exact ties are kept as
    ties. None for timing metrics, metrics without a direction, or no finished configuration with the metric."""
    if goal is None or is_timing(metric):
        return None
    scored = [(c, c.summary(metric)) for c in configs]
    scored = [(c, s) for c, s in scored if s.mean is not None and math.isfinite(s.mean)]
    if not scored:
        return None
    order = sorted(range(len(scored)), key=lambda i: (scored[i][1].mean if goal == "min" else -scored[i][1].mean, i))
    best, best_s = scored[order[0]]
    ties = [scored[i][0] for i in order if scored[i][1].mean == best_s.mean]
    rest = [i for i in order if scored[i][1].mean != best_s.mean]
    if len(ties) > 1:
        nxt = scored[rest[0]] if rest else (None, None)
        return Ranking(metric, goal, best, best_s, nxt[0], nxt[1], None, ties)
    if len(order) == 1:
        return Ranking(metric, goal, best, best_s)
    second, second_s = scored[order[1]]
    diff = compare(best.values(metric), second.values(metric))
    return Ranking(metric, goal, best, best_s, second, second_s, diff)


__all__ = ["Configuration", "Ranking", "configurations", "has_replicates", "rank", "is_timing", "metric_label",
           "TIMING_PREFIXES", "TIMING_KEYS", "MACHINE_NOTE"]
