"""What varies between the points of a sweep: the swept keys and their resolved values, the arm, the config keys
that differ. Swept keys are the override keys whose value differs between points; without overrides (W&B runs) they
are the config keys that differ, keys that vary together counted once.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from kdexp.report.model import MISSING, Point, Sweep, typed
from kdexp.track.records import parse_scalar

# Resolved-config keys that differ between points for bookkeeping reasons, not because of the experiment.
NOISE_PREFIXES = ("hydra", "paths", "logger", "_wandb")
ARM_KEYS = ("experiment_arm", "arm")
SEED_KEY = "trainer.seed"  # points that differ only in it are replicates of one configuration


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



def lookup(config: dict, key: str) -> Any:
    """The value at dotted ``key`` with ${...} interpolations resolved where OmegaConf can; MISSING if absent."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
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
    if value is not MISSING and not isinstance(value, (dict, list)):
        return value
    return parse_scalar(point.overrides.get(key))


def typed_value(point: Point, key: str) -> str:
    """``key``'s value as the user typed it on the command line when it is the value the point ran with ('1.0',
    '1e-3', 'topk'); else the resolved value written as YAML would (a float keeps its '.0'); a group option by name."""
    raw = point.overrides.get(key, MISSING)
    value = point.params.get(key, MISSING)
    if isinstance(raw, str) and (value is MISSING or parse_scalar(raw) == value or key in point.choices):
        return raw
    return typed(None if value is MISSING else value)


def _differing_override_keys(points: list[Point]) -> tuple[list[str], dict[str, str]]:
    keys = list(dict.fromkeys(k for p in points for k in p.overrides))
    swept, fixed = [], {}
    for k in keys:
        values = {p.overrides.get(k, MISSING) for p in points}
        if len(values) > 1:
            swept.append(k)
        else:
            fixed[k] = next(iter(values))
    return swept, fixed


def _signature(values: list[Any]) -> tuple:
    """How values split the points: equal signatures = the keys vary together."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(json.dumps(v, sort_keys=True, default=str), len(seen)) for v in values)


def _determined_by(coarse: tuple, fine: tuple) -> bool:
    """True when equal ``coarse`` classes always have equal ``fine`` values (fine is a function of coarse)."""
    seen: dict[int, int] = {}
    return all(seen.setdefault(c, f) == f for c, f in zip(coarse, fine))


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
        values = [None if v is MISSING else v for v in values]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            out[k] = values
    return out


def _arm_key(points: list[Point]) -> Optional[str]:
    for key in ARM_KEYS:
        if any(lookup(p.config, key) not in (MISSING, None) for p in points):
            return key
    return None


def build_sweep(points: list[Point], source: str) -> Sweep:
    """Order the points, find what is swept and fill ``params`` and ``arm``. Swept keys are the override keys whose
    value differs between points; without overrides (W&B runs) they are the config keys that differ, and keys that
    vary together (an arm changes loss.* and balancer.* at once) are one parameter, the others kept as aliases."""
    # Job number order where there is one; otherwise the order given (directory order, W&B creation order).
    # (A folder of several sweeps: sweep by sweep, kdexp.report.trainings names them.)
    points = sorted(points, key=lambda p: (p.sweep or "", p.num is None, p.num if p.num is not None else 0))
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
        arm_sig = _signature(diffs[arm_key]) if arm_key in diffs else None
        for key, values in diffs.items():
            sig = _signature(values)
            if arm_sig is not None and key != arm_key and _determined_by(arm_sig, sig):
                aliases.setdefault(arm_key, []).append(key)  # the arm sets it (loss.top_p only in the top_p arm)
            elif sig in by_signature:
                aliases.setdefault(by_signature[sig], []).append(key)
            else:
                by_signature[sig] = key
                swept.append(key)
    for p in points:
        p.params = {k: resolved_value(p, k) for k in swept}
        p.shown = {k: typed_value(p, k) for k in swept}
        seed = p.params[SEED_KEY] if SEED_KEY in p.params else resolved_value(p, SEED_KEY)
        p.seed = None if seed is MISSING else seed
        if arm_key is not None:
            arm = lookup(p.config, arm_key)
            p.arm = None if arm in (MISSING, None) else str(arm)
        elif "arm" in p.choices:
            p.arm = p.choices["arm"]
    if arm_key is None and any(p.arm is not None for p in points):
        arm_key = "arm"
    return Sweep(source=source, points=points, swept=swept, fixed={k: v for k, v in fixed.items() if v is not MISSING},
                 arm_key=arm_key, aliases=aliases, seed_key=SEED_KEY if SEED_KEY in swept else None)
