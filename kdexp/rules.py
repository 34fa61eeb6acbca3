"""Generic value rules, written once: each raises a one-line ``ValueError`` naming the key, the value and what it must
be (``<key>=<value> is invalid: <allowed>``).

Stdlib only: the config checks (kdexp.config), the loss and balancer options (kdexp.losses.options, torch-free) and
the model/data shapes all use these, so that "an integer that is not a bool" or "a finite number in a range" is one
rule with one message format.
"""
from __future__ import annotations

import math
from typing import Any, Optional


class ConfigError(ValueError):
    """A config value that only the prepared data or the teacher cache shows to be wrong (data too small for
    trainer.seq_length; a nucleus that overflows the cached top-K_max). Raised before the student is built and reported
    as the checks' errors are: one line naming the keys, the values and the fix, exit status 2 (kdexp.run)."""


def is_int(x: Any) -> bool:
    """An int that is not a bool (YAML ``true`` is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """An int or float that is not a bool (finiteness is the caller's rule)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{key}={value!r} is invalid: {allowed}")


def number(key: str, value: Any, *, gt: Optional[float] = None, ge: Optional[float] = None,
            lt: Optional[float] = None, le: Optional[float] = None) -> None:
    """A finite real number (not a bool) within the given bounds."""
    lo, hi = (gt, "(") if gt is not None else (ge, "["), (lt, ")") if lt is not None else (le, "]")
    if lo[0] is not None and hi[0] is not None:
        allowed = f"must be a finite number in {lo[1]}{lo[0]:g}, {hi[0]:g}{hi[1]}"
    else:
        bounds = [f"{op} {b:g}" for op, b in ((">", gt), (">=", ge), ("<", lt), ("<=", le)) if b is not None]
        allowed = "must be a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if not is_real(value) or not math.isfinite(value):
        fail(key, value, allowed)
    if (gt is not None and not value > gt) or (ge is not None and not value >= ge) or \
            (lt is not None and not value < lt) or (le is not None and not value <= le):
        fail(key, value, allowed)


def integer(key: str, value: Any, *, ge: Optional[int] = None, lt: Optional[int] = None,
             none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if ge is not None and lt is not None:
        allowed = f"must be an integer in [{ge}, {lt - 1}]"
    else:
        allowed = "must be an integer" + (f" >= {ge}" if ge is not None else "") + (f" < {lt}" if lt is not None else "")
    allowed += " (or null)" if none_ok else ""
    if not is_int(value) or (ge is not None and value < ge) or \
            (lt is not None and value >= lt):
        fail(key, value, allowed)


def text(key: str, value: Any, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, str) or not value.strip():
        fail(key, value, "must be a non-empty string" + (" (or null)" if none_ok else ""))


def choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        fail(key, value, "must be one of " + ", ".join("null" if c is None else str(c) for c in choices))
