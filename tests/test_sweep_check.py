"""A sweep is checked whole before its first point (kdexp.run._check_sweep, kdexp.config.multirun): every point
composed as Hydra composes it and validated, on every launcher, before the sweep dir exists; ``--dry-run`` lists the
points and which would be reused; a point refused for a reason only its setup finds is the single run's one line,
not a traceback, in the sweep's output and its end lines. Real ``python -m kdexp.run`` processes throughout."""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from _launch import UNCHECKED_RUN, kdexp_run
from kdexp.track import records

REPO = Path(__file__).resolve().parents[1]
ALPHA_LINE = "balancer.alpha=1.5 is invalid: must be a number in [0, 1]"


@pytest.fixture
def fresh(tmp_path):
    """An environment whose cache and cwd are this test's own, so that 'nothing written' can be checked."""
    e = {**os.environ, "KDEXP_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    for key in ("KDEXP_RUN_STAMP", "HYDRA_FULL_ERROR", "WORLD_SIZE", "RANK"):
        e.pop(key, None)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return e, cwd


def _nothing_written(env, cwd: Path) -> None:
    assert not list(cwd.iterdir()), list(cwd.rglob("*"))
    assert not Path(env["KDEXP_CACHE"]).exists(), list(Path(env["KDEXP_CACHE"]).rglob("*"))


@pytest.mark.parametrize("launcher", ["basic", "local_cpu", "slurm_cpu", "slurm_gpu"])
def test_one_bad_value_among_good_ones_refuses_the_sweep_before_anything_starts(fresh, launcher):
    env, cwd = fresh
    r = kdexp_run(["-m", "experiment=smoke", "balancer.alpha=0.5,1.5,1.0", f"hydra/launcher={launcher}"], env, cwd, check=False)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-4000:])
    assert r.stderr.splitlines() == [f"kdexp: error: {ALPHA_LINE} (sweep point #1 of 3: experiment=smoke "
                                     f"balancer.alpha=1.5; nothing was started)"]
    assert r.stdout == ""
    _nothing_written(env, cwd)


def test_each_combination_is_checked_against_the_cross_key_rules(fresh):
    """loss=dense and teacher=cached are each fine; together they are not (a cache holds only the top-K_max)."""
    env, cwd = fresh
    r = kdexp_run(["-m", "loss=topk,dense", "teacher=cached", "balancer.alpha=0.5,1.0"], env, cwd, check=False)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-4000:])
    (line,) = r.stderr.splitlines()
    assert line.startswith("kdexp: error: loss.top_k=None is invalid: must be set with teacher=cached"), line
    assert line.endswith("(sweep point #2 of 4: loss=dense teacher=cached balancer.alpha=0.5; also #3; nothing was "
                         "started)"), line
    _nothing_written(env, cwd)


def test_dry_run_lists_every_point_in_hydras_order_and_runs_nothing(fresh):
    env, cwd = fresh
    r = kdexp_run(["experiment=smoke", "--dry-run", "-m", "balancer.alpha=0.5,1.0", "loss=topk,top_p"], env, cwd, check=False)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    lines = r.stdout.splitlines()
    assert lines[0] == "[dry-run] 4 points, hydra/launcher=basic; nothing was built, written or launched"
    expected = [f"#{i} experiment=smoke balancer.alpha={a} loss={loss}: would train"
                for i, (a, loss) in enumerate(itertools.product(["0.5", "1.0"], ["topk", "top_p"]))]
    assert lines[1:] == expected
    _nothing_written(env, cwd)


def test_an_experiment_presets_own_sweep_is_listed_and_checked(fresh):
    """experiment=ghost_vs_renorm sweeps through hydra.sweeper.params (9 arms x 5 seeds) with hydra.mode=MULTIRUN,
    no -m: a temperature the teacher cache does not hold refuses all 45 points before the first."""
    env, cwd = fresh
    r = kdexp_run(["experiment=ghost_vs_renorm", "--dry-run"], env, cwd, check=False)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    lines = r.stdout.splitlines()
    assert lines[0].startswith("[dry-run] 45 points, hydra/launcher=basic;") and len(lines) == 46
    assert lines[1] == "#0 arm=k8_renorm trainer.seed=1 experiment=ghost_vs_renorm: would train"
    assert lines[45] == "#44 arm=topp_k128 trainer.seed=5 experiment=ghost_vs_renorm: would train"
    bad = kdexp_run(["experiment=ghost_vs_renorm", "loss.temperature=2.0"], env, cwd, check=False)
    assert bad.returncode == 2, (bad.stdout[-2000:], bad.stderr[-4000:])
    (line,) = bad.stderr.splitlines()
    assert line.startswith("kdexp: error: loss.temperature=2.0 is invalid: must be one of the cached "
                           "teacher.temperatures [1.0]"), line
    assert "(sweep point #0 of 45: " in line and "#44; nothing was started)" in line
    _nothing_written(env, cwd)


def test_what_depends_on_the_launchers_processes_is_checked_where_this_process_runs_the_points(fresh):
    """parallel.tensor=2 needs two processes: the basic launcher runs the points in this one process (refused);
    slurm_cpu gives each point two tasks (listed)."""
    env, cwd = fresh
    here = kdexp_run(["--dry-run", "-m", "parallel.tensor=1,2"], env, cwd, check=False)
    assert here.returncode == 2, (here.stdout[-2000:], here.stderr[-4000:])
    assert here.stdout.splitlines()[1:] == [
        "#0 parallel.tensor=1: would train",
        "#1 parallel.tensor=2: refused: parallel.tensor=2 is invalid: needs 2 processes (one per tensor-parallel rank) "
        "and this is one process: launch with `torchrun --nproc-per-node 2 -m kdexp.run ...`, as 2 SLURM tasks (`srun "
        "--ntasks 2 python -m kdexp.run ...`), or with hydra/launcher=slurm_gpu hydra.launcher.tasks_per_node=2",
        "[dry-run] 1 of 2 refused: the sweep would not start (exit 2)"]
    slurm = kdexp_run(["--dry-run", "-m", "parallel.tensor=1,2", "hydra/launcher=slurm_cpu"], env, cwd, check=False)
    assert slurm.returncode == 0, (slurm.stdout[-2000:], slurm.stderr[-4000:])
    assert slurm.stdout.splitlines()[0] == "[dry-run] 2 points, hydra/launcher=slurm_cpu; nothing was built, " \
                                           "written or launched"
    _nothing_written(env, cwd)


TOP_P = ["experiment=smoke", "loss=top_p", "teacher=cached", "logger=none"]


def test_a_point_its_setup_refuses_is_the_single_runs_one_line_and_dry_run_marks_reuse(fresh, seeded_cache):
    """The nucleus of loss.top_p=0.95 overflows the smoke teacher cache's top-1024, which only the built cache shows:
    the sweep trains top_p=0.8, then point #1 prints exactly the line a single run of it prints, no traceback, and
    the end lines name it. A dry run of the same sweep afterwards says #0 would be reused."""
    env, cwd = fresh
    seeded_cache(env["KDEXP_CACHE"])  # the smoke data and pretrained teacher (built once for the test run), no points
    sweep_dir = cwd / "sweep"
    r = kdexp_run([*TOP_P, "-m", "loss.top_p=0.8,0.95", f"hydra.sweep.dir={sweep_dir}"], env, cwd, check=False)
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-4000:])
    assert "Traceback" not in r.stdout + r.stderr
    single = kdexp_run([*TOP_P, "loss.top_p=0.95", f"hydra.run.dir={cwd / 'single'}"], env, cwd, check=False)
    assert single.returncode == 2, (single.stdout[-3000:], single.stderr[-4000:])
    line = single.stderr.splitlines()[-1]
    assert line.startswith("kdexp: error: loss.top_p=0.95 does not fit in the teacher cache's top-1024"), line
    assert line in r.stderr.splitlines()
    reason = line.removeprefix("kdexp: error: ")
    assert f"[sweep] failed #1: loss.top_p=0.95: {reason} (see {sweep_dir / '1'}/{records.ERROR_LOG})" \
        in r.stdout.splitlines()
    sweep = records.read_json(sweep_dir / records.SWEEP)
    assert [(p["status"], p["error"]) for p in sweep["points"]] == [("finished", None), ("failed", reason)]

    dry = kdexp_run([*TOP_P, "--dry-run", "-m", "loss.top_p=0.8,0.95"], env, cwd, check=False)
    assert dry.returncode == 0, (dry.stdout[-2000:], dry.stderr[-4000:])
    assert dry.stdout.splitlines()[1:] == [
        f"#0 {' '.join(TOP_P)} loss.top_p=0.8: would reuse sweep/0 (finished)",  # relative to the cwd
        f"#1 {' '.join(TOP_P)} loss.top_p=0.95: would train"]


def test_a_point_the_jobs_own_validation_refuses_is_one_line_too(fresh):
    """A sweeper that chooses its points as it runs gets no check before the launch (tests/_unchecked_run.py stands
    for one): the job's own validation refuses the point with the single run's line, and the sweep goes on."""
    env, cwd = fresh
    sweep_dir = cwd / "sweep"
    r = kdexp_run(["-m", "trainer.seed=-1,-2", f"hydra.sweep.dir={sweep_dir}"], env, cwd, check=False,
                  entry=UNCHECKED_RUN)
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-4000:])
    assert "Traceback" not in r.stdout + r.stderr
    sweep = records.read_json(sweep_dir / records.SWEEP)
    assert sweep["points"] == []  # refused before they claimed a run dir: named in sweep.json, nothing on disk
    refused = sorted(sweep["refused"], key=lambda x: x["num"])
    for p, seed in zip(refused, (-1, -2), strict=True):
        reason = f"trainer.seed={seed} is invalid: must be an integer in [0, 4294967295]"
        assert p["error"] == reason and f"trainer.seed={seed}" in p["overrides"]
        assert f"kdexp: error: {reason}" in r.stderr.splitlines()
    assert not (sweep_dir / "0").exists() and not (sweep_dir / "1").exists()
    assert not Path(env["KDEXP_CACHE"], "teacher").exists()  # refused before any work
