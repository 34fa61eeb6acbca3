"""Where site-local launcher settings (SLURM partition, account, qos, setup lines) live: outside the package.

The resolver ``kdexp_site_dir`` (registered on import; kdexp.track.sweep imports this module) is meant for
``hydra.searchpath`` in conf/config.yaml. It names the first of
  1. ``$KDEXP_SITE_DIR`` (must exist),
  2. ``$XDG_CONFIG_HOME/kdexp`` (default ``~/.config/kdexp``) when that directory exists,
and otherwise ``pkg://kdexp.launchers`` (a package holding no config groups, so the search path gains nothing and
Hydra does not warn about a missing directory). The SLURM presets end their defaults list with
``optional /site@_here_: local``, so ``<site dir>/site/local.yaml`` is merged into ``hydra.launcher`` when it
exists; any other config group (``hydra/launcher/<name>.yaml``, ``experiment/<name>.yaml``) put in the site dir is
found as well. See launchers/site.yaml.example.
"""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

SITE_ENV = "KDEXP_SITE_DIR"
EMPTY_SEARCHPATH = "pkg://kdexp.launchers"


def user_site_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kdexp"


def site_dir() -> Path | None:
    """The site config directory in use, or None."""
    env = os.environ.get(SITE_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise ValueError(f"{SITE_ENV}={env!r} is not a directory; create it (with site/local.yaml) or unset it")
        return path.resolve()
    path = user_site_dir()
    return path.resolve() if path.is_dir() else None


def site_searchpath() -> str:
    path = site_dir()
    return f"file://{path}" if path is not None else EMPTY_SEARCHPATH


if not OmegaConf.has_resolver("kdexp_site_dir"):
    OmegaConf.register_new_resolver("kdexp_site_dir", site_searchpath)
