"""The command line's overrides checked against what exists, before Hydra composes anything: a typo never runs a
different job.

Hydra alone lets two typos through: an ``optional`` defaults entry (``- optional arm: null``) drops an option that
does not exist without a word (``hydra._internal.defaults_list._create_defaults_tree_impl``: a missing config of an
optional default is marked ``deleted``), and ``+key=value`` adds a key the struct schema does not know (it opens the
struct flag). conf/config.yaml lists arm and experiment as plain ``null`` defaults (so Hydra itself now refuses a
missing option too), and ``check`` here gives each case one line with the options or the closest key:

- ``group=option`` (also ``+group=``, sweeps ``group=a,b`` and lists ``group=[a,b]``): every option must exist in
  the group, looked up on Hydra's own search path (the package's conf, its launchers, the site dir, plugins);
- ``key=value`` / ``+key=value`` / ``++key=value``: the key must be a field of the schema (kdexp.config.schema), the
  error names the closest one (difflib). ``hydra.*`` keys are Hydra's own and left to it.

``unknown_keys(cfg)`` is the same schema rule for a composed config (kdexp.config.validate calls it), for configs
composed without this command line: the compose API, a sweeper's params.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from functools import cache
from typing import Any, Iterable, Optional

PRIMARY = ("kdexp.conf", "config")  # hydra.main's config module and name in kdexp.run


def _fail(line: str) -> None:
    raise ValueError(line)


@cache
def schema_keys() -> dict:
    """Every dotted key of the schema -> whether it is a leaf (a value) rather than a node (a dataclass)."""
    from kdexp.config.schema import KdexpConfig

    out: dict = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            hint = hints.get(f.name)
            node = isinstance(hint, type) and dataclasses.is_dataclass(hint)
            out[key] = not node
            if node:
                walk(hint, key + ".")

    walk(KdexpConfig, "")
    return out


def closest(word: str, candidates: Iterable[str]) -> Optional[str]:
    hits = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


def key_problem(key: str) -> Optional[str]:
    """Why a dotted key is not in the schema (None when it is). Keys below a leaf (a list's items, e.g.
    loss.intermediate.0.kind) are the leaf's type's business, left to OmegaConf."""
    keys = schema_keys()
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        head = ".".join(parts[:i])
        if head not in keys:
            near = closest(key, keys) or closest(head, keys)
            return f"the config has no key {key!r}" + (f" (did you mean {near!r}?)" if near else "")
        if keys[head]:  # a leaf: anything below it is its value's structure
            return None
    return None


def unknown_keys(cfg: Any) -> None:
    """ValueError naming the first key of a composed config that the schema does not know (one added with
    ``+key=value``) and the closest key."""
    from omegaconf import DictConfig

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, DictConfig):
            return
        for k in node.keys():
            key = f"{prefix}{k}"
            if not prefix and k == "hydra":
                continue
            problem = key_problem(key)
            if problem:
                _fail(f"{key} is not a kdexp option: {problem}")
            if not schema_keys()[key]:
                walk(node._get_node(k), key + ".")

    walk(cfg, "")


def _values(override: Any) -> list:
    """The option names a group override asks for (one, a list, or a sweep's choices)."""
    if override.is_sweep_override():
        try:
            return [str(v) for v in override.sweep_string_iterator()]
        except Exception:  # a range/interval sweep over a group: Hydra reports it
            return []
    value = override.value()
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


class _Groups:
    """Hydra's config search path for kdexp.run's primary config, opened once, only when a group is named."""

    def __init__(self) -> None:
        self._options: dict = {}

    def options(self, group: str) -> list:
        if group not in self._options:
            from hydra import initialize_config_module
            from hydra.core.global_hydra import GlobalHydra

            module, name = PRIMARY
            # the context restores Hydra's global state, so that hydra.main then starts as it would without this
            with initialize_config_module(module, version_base="1.3"):
                loader = GlobalHydra.instance().config_loader()
                self._options[group] = loader.get_group_options(group, config_name=name)
        return self._options[group]


def check(overrides: list) -> None:
    """ValueError (one line) for the first override that names a group option or a key that does not exist.
    An override Hydra's grammar cannot parse is left to Hydra, which reports it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except HydraException:
        return
    groups = _Groups()
    for o in parsed:
        key = o.key_or_group
        typed = o.input_line or key
        if key == "hydra" or key.startswith("hydra.") or o.is_delete():
            continue
        if "." not in key:
            options = groups.options(key)
            if not options and "/" in key:
                _fail(f"{typed}: there is no config group {key!r}")
            if options:
                for value in _values(o):
                    if value not in options:
                        near = closest(value, options)
                        hint = f" (did you mean {key}={near}?)" if near else ""
                        _fail(f"{typed}: {key} has no option {value!r}{hint}; the options are: {', '.join(options)}")
                continue
        problem = key_problem(key)
        if problem:
            _fail(f"{typed}: {problem}")
