"""A multirun's points, composed in the submitting process the way Hydra will compose them, so that every point can be
checked before the sweep dir exists or a launcher starts a job.

Hydra 1.3 (hydra/_internal/hydra.py ``Hydra.multirun``, core_plugins/basic_sweeper.py ``BasicSweeper.sweep``,
core_plugins/basic_launcher.py) composes the primary config in MULTIRUN mode, joins ``hydra.sweeper.params`` (an
experiment's sweep) and the command line's task overrides, expands them into the cartesian product
(``BasicSweeper.split_arguments``) and composes each job with ``ConfigLoader.load_sweep_config`` (the hydra overrides
plus the point's). ``compose`` does the same with the same functions; ``expand`` is the expansion alone, which the
sweep's bookkeeping (kdexp.track.hydra_adapter.plan_points) uses too. Another sweeper (Optuna, Ax: points chosen as
results arrive) has no list to check: ``Sweep.points`` is None then.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from kdexp.config.overrides import PRIMARY

BASIC_SWEEPER = "BasicSweeper"
BASIC_LAUNCHER = "BasicLauncher"


def expand(params: Any, task_overrides: Sequence[str], config_loader: Any = None) -> list[list[str]]:
    """Every point's overrides in job-number order: ``hydra.sweeper.params`` then the task overrides, as the basic
    sweeper expands them (``config_loader`` lets ``glob()`` over a group's options expand; HydraException otherwise)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [f"{k}={v}" for k, v in (params or {}).items()] + list(task_overrides)
    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(args)
    return [list(p) for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]


@dataclass
class Sweep:
    """What ``hydra.main`` will do with a command line: a multirun or not, its launcher and, for the basic sweeper,
    each point's overrides."""

    multirun: bool
    launcher: str = ""  # the launcher's _target_
    launcher_choice: str = ""  # what hydra/launcher= chose (basic when the config does not choose)
    points: Optional[list[list[str]]] = None

    @property
    def in_process(self) -> bool:
        """The basic launcher runs every point in this process (its world size and this machine are the job's)."""
        return self.launcher.endswith(BASIC_LAUNCHER)


def _task_config(loader: Any, master: Any, point: list[str]) -> Any:
    """The point's task config as hydra.core.utils.run_job hands it to the task function: the ``hydra`` node removed
    and HydraConfig set (the task config may read ``${hydra:...}``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    cfg = loader.load_sweep_config(master, point)
    HydraConfig.instance().set_config(cfg)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def compose(overrides: Sequence[str], multirun_flag: bool,
            each: Optional[Callable[[Sweep, int, list[str], Any], None]] = None, single: bool = False) -> Sweep:
    """The sweep a command line starts (``multirun_flag``: ``-m`` was given; a config may also set hydra.mode=MULTIRUN,
    as an experiment preset with its own sweep does); ``each(sweep, num, overrides, task config)`` is called for every
    point in job-number order while Hydra's state is the job's. Hydra's own errors (an override it cannot parse, a config it
    cannot compose) propagate; the caller leaves them to hydra.main, which reports them as it always does. ``single``:
    a command line that is no multirun is one point (its overrides), else it has no points."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    module, name = PRIMARY
    # the context restores Hydra's global state, so that hydra.main then starts as it would without this
    with initialize_config_module(module, version_base="1.3"):
        gh = GlobalHydra.instance()
        loader = gh.config_loader()
        master = gh.hydra.compose_config(name, list(overrides), run_mode=RunMode.MULTIRUN)
        multirun = multirun_flag or master.hydra.mode == RunMode.MULTIRUN
        sweep = Sweep(multirun=multirun, launcher=str(master.hydra.launcher.get("_target_", "")),
                      launcher_choice=str(master.hydra.runtime.choices.get("hydra/launcher") or "basic"))
        if not multirun:
            if not single:
                return sweep
            sweep.points = [list(master.hydra.overrides.task)]
        elif str(master.hydra.sweeper.get("_target_", "")).endswith(BASIC_SWEEPER):
            sweep.points = expand(master.hydra.sweeper.get("params"), master.hydra.overrides.task, loader)
        else:
            return sweep
        if each is not None:
            try:
                for num, point in enumerate(sweep.points):
                    each(sweep, num, point, _task_config(loader, master, point))
            finally:
                HydraConfig.instance().cfg = None  # hydra.main sets its own
    return sweep


@dataclass
class Point:
    """One point as checked: its number, overrides, the one line refusing it (None when every check passed) and
    what ``describe`` said of it (e.g. whether it would be reused)."""

    num: int
    overrides: list[str]
    refused: Optional[str] = None
    note: str = ""


def check(overrides: Sequence[str], multirun_flag: bool, describe: Optional[Callable[[Any], str]] = None,
          in_process_checks: Sequence[Callable[[Any], None]] = (), single: bool = False) -> tuple[Sweep, list[Point]]:
    """Every point of the sweep validated (kdexp.config.validate and, when the basic launcher runs the points in this
    process, check_launch and ``in_process_checks``: what depends on the job's own processes);
    a ValueError refuses the point with its one line. ``describe(cfg)`` notes each point that passed."""
    from kdexp.config.checks import check_launch, validate

    out: list[Point] = []

    def each(sweep: Sweep, num: int, point: list[str], cfg: Any) -> None:
        item = Point(num, point)
        try:
            validate(cfg)
            for fn in (check_launch, *in_process_checks) if sweep.in_process else ():
                fn(cfg)
            item.note = describe(cfg) if describe is not None else ""
        except ValueError as err:
            item.refused = str(err)
        out.append(item)

    return compose(overrides, multirun_flag, each, single=single), out
