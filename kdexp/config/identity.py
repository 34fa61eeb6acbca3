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
    prompts = (data.get("rollout") or {}).get("prompts")
    if prompts:  # the prompts a run trains on are the file's lines: an edited file at the same path is another run
        data["rollout"]["prompts_sha256"] = _file_sha256(prompts)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return "unreadable"  # validate refuses such a file before any run; the hash of the path alone stands
