"""Session-wide test setup: no test reads or writes the user's kdexp cache; how xdist workers share the run.

KDEXP_CACHE (the tokenizer, token files, dataset indices, the embedded teacher, the finished-points index) is set to a
fresh temporary directory for the whole test run, whatever the shell had, and removed at the end; subprocesses the
tests start inherit it. Under pytest-xdist (``make test`` runs two workers) the controller makes it and the workers
inherit it, so the run has one session cache as a serial run does (its builds take a file lock: concurrent runs on a
cold cache build once). Tests that need a cache of their own still set KDEXP_CACHE themselves; the `env` fixture
below is that, per test module, for the modules that run `python -m kdexp.run` in subprocesses.

Placement under ``--dist loadgroup`` (pytest_xdist_make_scheduler below): each module's tests are one work unit, run
on one worker (module fixtures, such as a module's smoke run or its own cache, are then built once), except the
modules in SHARED_GROUPS, which share a unit because they share a build memoized per process or a build dir, and
the cases of SPLIT_TESTS, each a unit; units start heaviest first (HEAVY_FIRST) so that the longest ones do not start
last and leave the other worker idle. Under N workers each one, and every run it starts, gets OMP_NUM_THREADS =
cores // N (unless the shell set it): torch's threads of two workers on two cores would otherwise spin against each
other.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from _launch import kdexp_run, run_env

_SESSION_CACHE: list[str] = []
_WORKER = "PYTEST_XDIST_WORKER"

# Modules that read one build memoized per process (tests/sweeps.py's real tiny sweep): one group, one worker, one
# build. Modules that build kdexp's wheel from the source tree, one after another: setuptools writes build/ and
# kdexp.egg-info there, and two builds at once clobbered each other's (a CI run's three test_package errors). The
# SLURM tests are one module already (one cluster, jobs queued on one node).
SHARED_GROUPS = {"test_report": "real_sweep", "test_notebook": "real_sweep", "test_tensorboard": "real_sweep",
                 "test_package": "wheel_builds", "test_wheelhouse": "wheel_builds"}
# Groups in the order they start, before all others (which keep their collection order): the ones that run the most
# processes (subprocess runs, torchrun pairs, SLURM jobs) first.
HEAVY_FIRST = ("test_train", "test_scale", "test_slurm", "real_sweep", "test_teacher_cache_run",
               "test_teacher_cache_sweep", "test_teacher_cache_hidden", "test_sweep", "test_cli", "test_readme",
               "test_run_records", "test_experiment", "test_divergence", "test_slots", "test_intermediate",
               "test_faults", "test_teacher_cache", "test_cache", "test_package", "test_wheelhouse",
               "test_report_trainings", "test_dashboard", "test_checkpoint", "test_sweep_check", "test_wandb")
# Tests each of whose cases is a work unit of its own (a module's groups rank as the module): a page of the docs runs
# for minutes as its own reader's session (tests/test_readme.py), so the pages share out over the workers.
SPLIT_TESTS = ("test_readme.py::test_page_runs",)


def pytest_configure(config):
    if os.environ.get(_WORKER) and os.environ.get("KDEXP_CACHE", "").startswith(_cache_prefix()):
        return  # an xdist worker: the controller's session cache (inherited)
    workers = getattr(config.option, "numprocesses", None) or 0
    if isinstance(workers, int) and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # The cores shared out between the workers, as kdexp.track.slots shares them between a sweep's points: each
        # worker and every run it starts (inherited) takes its share, instead of each taking every core and their
        # OpenMP threads spinning against each other's.
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))
    cache = tempfile.mkdtemp(prefix="kdexp-test-cache-")
    _SESSION_CACHE.append(cache)
    os.environ["KDEXP_CACHE"] = cache


def pytest_unconfigure(config):
    while _SESSION_CACHE:  # only the process that made it removes it
        shutil.rmtree(_SESSION_CACHE.pop(), ignore_errors=True)


def _cache_prefix() -> str:
    return os.path.join(tempfile.gettempdir(), "kdexp-test-cache-")


def group_of(nodeid: str) -> str:
    """The xdist work unit a test belongs to: its module's name, the shared group of SHARED_GROUPS, or the test case
    itself for SPLIT_TESTS."""
    path, _, name = nodeid.partition("::")
    if f"{Path(path).name}::{name.split('[', 1)[0]}" in SPLIT_TESTS:
        return nodeid
    module = Path(path).stem
    return SHARED_GROUPS.get(module, module)


def _rank_of(nodeid: str, rank: dict) -> int:
    """The place of a test's group in HEAVY_FIRST (a split test's cases: their module's), else after them all."""
    group = group_of(nodeid)
    return rank.get(group, rank.get(Path(nodeid.split("::", 1)[0]).stem, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with group_of's groups, each one work unit on one worker. (xdist 3.8 marks a group by
    renaming the test's node id, which pytest 9 no longer takes: its own loadgroup would run every test alone.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """The heavy groups first (the order xdist hands out work units in, with --no-loadscope-reorder), each module's
    tests kept together and in their order (module fixtures are set up once)."""
    rank = {g: i for i, g in enumerate(HEAVY_FIRST)}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(group_of(item.nodeid), i)
    items.sort(key=lambda it: (_rank_of(it.nodeid, rank), first_seen[group_of(it.nodeid)]))


def _shared_root(tmp_path_factory) -> Path:
    """A directory every process of this test run sees: the base temp dir, the workers' common parent under xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get(_WORKER) else base


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> Path:
    """A KDEXP_CACHE holding what an ``experiment=smoke`` run builds before it trains: the tokenizer, the token files,
    the dataset indices, the pretrained embedded teacher (30 steps), the C kernel. Built once per test run by one
    real ``python -m kdexp.run experiment=smoke`` (xdist workers take a file lock; the second finds it done), without
    its finished-points index, so that no test reuses that run. Copy it (seeded_cache), never write into it."""
    root = _shared_root(tmp_path_factory)
    cache, done = root / "warm_kdexp_cache", root / "warm_kdexp_cache.done"
    with open(root / "warm_kdexp_cache.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(cache, ignore_errors=True)
            run = root / "warm_kdexp_cache.run"
            kdexp_run(["experiment=smoke", "logger=none", "trainer.max_steps=1", "trainer.warmup_steps=0",
                       "trainer.eval_interval=1", "trainer.checkpoint_interval=1", f"hydra.run.dir={run}"],
                      run_env(cache), root)
            shutil.rmtree(cache / "points", ignore_errors=True)
            shutil.rmtree(run, ignore_errors=True)
            done.touch()
    return cache


@pytest.fixture(scope="session")
def seeded_cache(warm_cache):
    """seeded_cache(dest) -> dest: a fresh KDEXP_CACHE at dest, a copy of warm_cache (the smoke teacher pretrained,
    the data built), with no finished points."""
    def seed(dest) -> Path:
        shutil.copytree(warm_cache, dest)
        return Path(dest)
    return seed


@pytest.fixture(scope="module")
def env(tmp_path_factory, seeded_cache):
    """The environment of a module's kdexp.run subprocesses: a KDEXP_CACHE of the module's own, seeded with the smoke
    experiment's data and pretrained teacher (seeded_cache), W&B offline, unbuffered output, no inherited run stamp.
    A module that needs another environment (a cold cache, say) defines its own `env`."""
    return run_env(seeded_cache(tmp_path_factory.mktemp("kdexp_env") / "cache"))
