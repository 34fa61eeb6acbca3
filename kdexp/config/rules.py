"""The one config rule that needs OmegaConf: a required value left unset or an interpolation that does not resolve.
The generic value rules (numbers, integers, choices) are kdexp.rules, shared with the torch-free loss options."""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kdexp.rules import fail


def unresolved(cfg: Any) -> None:
    """A required value left unset (``???``) or an interpolation that does not resolve, named by its key."""
    if not OmegaConf.is_config(cfg):
        return
    try:
        missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
        if missing:
            fail(missing[0], "???", "must be set (this option requires it)")
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        raise ValueError(f"{key}={raw!r} is invalid: {type(err).__name__}: {str(err).splitlines()[0]}") from None
