"""Each training counted once: the run dirs of a folder -> the trainings they hold, and the sweeps the folder merges.

A point is identified by what it trained: its config hash (``kdexp.config.config_hash``, which covers the seed) and
its seed. Run dirs that hold the same training are one point:
  - a point reused from an earlier sweep (``reused_from``) is the training it reuses, not another replicate;
  - the same config trained again (reuse turned off) is the same experiment with the same seed, not a replicate;
  - an earlier failed or interrupted attempt at a config that a later run trained is superseded by it.
The point kept is the one that says most (finished, then diverged, running, pending, interrupted, failed; a run that
trained before one that reused it; then sweep order); the others are named in its ``copies`` and in the sweep's
``duplicates``, so the report says what it folded and why.

A folder holding several sweeps (``multirun/<date>`` with a sweep and its rerun) is reported as one, naming the
sweeps it merged, when every setting each sweep held constant agrees between them; a setting held at different
values (``trainer.max_steps=2`` in one, ``4`` in the other, or set in one and left at its default in the other)
would make their points incomparable, so ``merge_sweeps`` refuses such a folder with one line naming the key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Hashable, Optional

from kdexp.report.model import MISSING, Point
from kdexp.report.params import SEED_KEY, resolved_value
from kdexp.track import records

# which point of a training the report keeps: the lower, the more it says
_KEEP_ORDER = {"finished": 0, "diverged": 1, "running": 2, "pending": 3, "interrupted": 4, "failed": 5}
SWEEP_MARKERS = (records.SWEEP, "multirun.yaml")


def _resolved(path: Any) -> Optional[Path]:
    try:
        return Path(path).resolve()
    except (TypeError, OSError):
        return None


def identities(points: list[Point]) -> list[Optional[Hashable]]:
    """Per point, what it trained: (config hash, seed) when its records name a config hash, else the identity of
    the point its ``reused_from`` names when that one is in the list; None when unknown (the point stands alone)."""
    by_dir = {_resolved(p.run_dir): p for p in points if p.run_dir is not None}
    out: list[Optional[Hashable]] = []
    for p in points:
        source = p
        if not p.config_hash and p.reused_from:
            source = by_dir.get(_resolved(p.reused_from), p)
        seed = resolved_value(p, SEED_KEY)
        out.append((source.config_hash, repr(None if seed is MISSING else seed)) if source.config_hash else None)
    return out


def _why(kept: Point, other: Point) -> str:
    if other.reused_from:
        return "reuses it"
    if other.status == "finished":
        return "trained the same config and seed again (not counted)"
    return f"an earlier {other.status} attempt, superseded"


def count_once(points: list[Point]) -> tuple[list[Point], list[tuple[str, str, str]]]:
    """The points with each training once (in the order of the kept points), and the folded ones as
    (folded point's name, kept point's name, why)."""
    groups: dict[Hashable, list[int]] = {}
    for i, ident in enumerate(identities(points)):
        groups.setdefault(ident if ident is not None else ("alone", i), []).append(i)
    keep: dict[int, list[int]] = {}
    for members in groups.values():
        members.sort(key=lambda i: (_KEEP_ORDER.get(points[i].status, 9), bool(points[i].reused_from), i))
        keep[members[0]] = members[1:]
    kept, folded = [], []
    for i, p in enumerate(points):
        if i not in keep:
            continue
        for j in keep[i]:
            p.copies.append(points[j].name)
            folded.append((points[j].name, p.name, _why(p, points[j])))
        kept.append(p)
    return kept, folded


# ---------------------------------------------------------------------------------------------------------------------
def sweep_of(run_dir: Path, root: Path) -> Optional[Path]:
    """The sweep dir a run dir belongs to: its nearest parent, up to ``root``, holding sweep.json or multirun.yaml."""
    root = root.resolve()
    here = run_dir.resolve().parent
    while True:
        if any((here / m).is_file() for m in SWEEP_MARKERS):
            return here
        if here == root or root not in here.parents:
            return None
        here = here.parent


def _held(points: list[Point]) -> dict[str, Any]:
    """The override keys one sweep held at one value over all its points (MISSING: left at the default)."""
    keys = dict.fromkeys(k for p in points for k in p.overrides)
    out = {}
    for k in keys:
        values = {p.overrides.get(k, MISSING) for p in points}
        if len(values) == 1:
            out[k] = values.pop()
    return out


def _shown(value: Any) -> str:
    return "(default)" if value is MISSING else ("(deleted)" if value is None else str(value))


def merge_sweeps(points: list[Point], root: Path) -> list[str]:
    """The sweeps under ``root`` whose points are merged (names relative to root, '.' for root itself; empty when
    the points come from one sweep or none). Sets each point's ``sweep``. Raises ValueError (one line) when two
    sweeps held a setting at different values."""
    groups: dict[str, list[Point]] = {}
    for p in points:
        where = sweep_of(p.run_dir, root) if p.run_dir is not None else root.resolve()
        if where is not None:
            p.sweep = Path(where).resolve().relative_to(root.resolve()).as_posix() if where != root.resolve() else "."
            groups.setdefault(p.sweep, []).append(p)
    if len(groups) < 2:
        return []
    held = {name: _held(members) for name, members in groups.items()}
    swept_somewhere = {k for name, members in groups.items() for p in members for k in p.overrides
                       if k not in held[name]}
    for key in dict.fromkeys(k for h in held.values() for k in h):
        if key in swept_somewhere:
            continue
        values = {name: h.get(key, MISSING) for name, h in held.items()}
        if len({repr(v) for v in values.values()}) > 1:
            shown = ", ".join(f"{key}={_shown(v)} in {name}" for name, v in values.items())
            raise ValueError(f"{root} holds {len(groups)} sweeps whose common settings differ ({shown}): their points "
                             f"are not comparable; report each sweep dir on its own")
    return list(groups)


__all__ = ["count_once", "identities", "merge_sweeps", "sweep_of", "SWEEP_MARKERS"]
