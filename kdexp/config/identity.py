"""The identity of a run: a hash of its resolved config minus where files go and how it is watched."""
from __future__ import annotations

import hashlib
import json

from omegaconf import DictConfig, OmegaConf

# Keys that do not change what a run computes: where files go and how it is watched.
_IDENTITY_EXCLUDE = ("logger", "paths", "launch")


def config_hash(cfg: DictConfig) -> str:
    """A short hash of the resolved config minus logging and paths: the identity of a sweep point."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in _IDENTITY_EXCLUDE:
        data.pop(key, None)
    data.pop("hydra", None)
    data.get("trainer", {}).pop("overwrite", None)  # what happens to an earlier run in the dir, not what is computed
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
