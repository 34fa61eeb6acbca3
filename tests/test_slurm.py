"""Sweeps on the real one-node SLURM cluster of launchers/start_slurm.sh.

The cluster fixture uses a running cluster, or starts it (root + apt-get: tests/_slurm_cluster.py), or skips these
tests with the reason in pytest's summary; under CI=true a cluster that cannot be started fails them instead.
Each point runs as a 2-task SLURM job (the slurm_cpu preset) whose tasks talk over gloo. The Python that srun starts
in each task hands its work over to the test's fork server and stands in for it (tests/_site/sitecustomize.py), as
torchrun's ranks do: SLURM still schedules, signals, requeues and waits for the task.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import _slurm_cluster
from _launch import kdexp_popen, kdexp_run
from _sweep_apps import app_env, load_sweep, run_app, sweep_dirs, write_app


@pytest.fixture(scope="session")
def slurm_problem():
    """Once per session (per xdist worker; they serialize on a lock): None when the cluster is usable."""
    return _slurm_cluster.ensure()


@pytest.fixture
def slurm_cluster(slurm_problem):
    if slurm_problem is not None:
        _slurm_cluster.skip_or_fail(slurm_problem)


# --- the skip / start / fail decision, without a cluster -----------------------------------------------------------
@pytest.fixture
def no_cluster(tmp_path, monkeypatch):
    """A PATH whose sinfo cannot reach a controller, and a private lock file."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sinfo").write_text("#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller' >&2\n"
                                "exit 1\n")
    (fake / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:/usr/bin:/bin")
    monkeypatch.setattr(_slurm_cluster, "LOCK", tmp_path / "start.lock")
    return fake


def test_without_root_the_slurm_tests_skip_and_under_ci_fail(no_cluster, monkeypatch):
    monkeypatch.setattr(_slurm_cluster.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(_slurm_cluster, "START_CMD", ["false"])  # must not be reached
    reason = _slurm_cluster.ensure()
    assert "Unable to contact slurm controller" in reason and "needs root" in reason
    with pytest.raises(pytest.skip.Exception, match="SLURM tests: SLURM is not running.*needs root"):
        _slurm_cluster.skip_or_fail(reason, env={})
    for ci in ("true", "1", "TRUE"):
        with pytest.raises(pytest.fail.Exception, match="CI=true and the SLURM cluster is not usable"):
            _slurm_cluster.skip_or_fail(reason, env={"CI": ci})


def test_as_root_a_failing_start_script_is_reported(no_cluster, monkeypatch):
    script = no_cluster / "start"
    script.write_text("#!/bin/sh\necho \"$0 ran\" > \"$(dirname \"$0\")/ran\"\necho 'apt-get: no network' >&2\n"
                      "exit 7\n")
    script.chmod(0o755)
    monkeypatch.setattr(_slurm_cluster.os, "geteuid", lambda: 0)
    (no_cluster / "apt-get").write_text("#!/bin/sh\nexit 1\n")  # present (the script would call it), never run
    (no_cluster / "apt-get").chmod(0o755)
    monkeypatch.setattr(_slurm_cluster, "START_CMD", [str(script)])
    reason = _slurm_cluster.ensure()
    assert (no_cluster / "ran").exists()
    assert "exited 7" in reason and "apt-get: no network" in reason
    with pytest.raises(pytest.fail.Exception, match="exited 7"):
        _slurm_cluster.skip_or_fail(reason, env={"CI": "true"})


def _cancel_jobs(root: Path) -> None:
    """Cancel what a test left on the cluster: job ids are the names of submitit's per-job folders."""
    ids = {p.name.split("_")[0] for p in root.rglob(".submitit/*") if p.name[:1].isdigit()}
    if ids:
        subprocess.run(["scancel", *sorted(ids)], capture_output=True, timeout=60)


def _diagnostics(root: Path) -> str:
    logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(root.rglob(".submitit/*/*.out")))
    q = subprocess.run(["squeue", "-l"], capture_output=True, text=True).stdout
    return f"squeue:\n{q}\n{logs}"


GLOO_TASK = """\
def task(cfg):
    import submitit
    import torch
    import torch.distributed as dist

    if cfg.x == 3:  # on every rank, before the process group: the point fails cleanly
        raise RuntimeError("point x=3 fails on purpose")
    env = submitit.helpers.TorchDistributedEnvironment().export()
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    t = torch.tensor([float(env.rank + 1) * cfg.x], dtype=torch.float64)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"sum": t.item(), "world": env.world_size, "ntasks": int(os.environ["SLURM_NTASKS"])}
"""


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_the_start_script_counts_every_cpu_whatever_omp_num_threads_says():
    # nproc obeys OMP_NUM_THREADS, which the test workers set to cores // workers: a cluster started from a worker got
    # a node of one CPU, on which every 2-task job pended for ever (reason PartitionConfig)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1"}
    r = subprocess.run(_slurm_cluster.START_CMD, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    node = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True, check=True).stdout
    assert int(re.search(r"CPUTot=(\d+)", node).group(1)) == len(os.sched_getaffinity(0)), node


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_sweep_of_two_task_points_with_gloo_all_reduce(tmp_path):
    script = write_app(tmp_path / "app", GLOO_TASK, name="gloo_app")
    root = tmp_path / "sweeps"
    try:
        r = run_app(script, ["x=1,2,3", "hydra/launcher=slurm_cpu", "hydra.launcher.timeout_min=10"], root,
                    timeout=600)
    except AssertionError as e:  # past its timeout: killed, its output in e
        pytest.fail(f"sweep did not end in 600 s: {e}\n{_diagnostics(root)}")
    finally:
        _cancel_jobs(root)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out + _diagnostics(root)  # x=3 failed; the others ran
    s = load_sweep(root)
    assert [p["status"] for p in s["points"]] == ["finished", "finished", "failed"], out
    for p, x in zip(s["points"][:2], (1, 2)):
        # all_reduce over ranks 0 and 1 of (rank + 1) * x
        assert p["metrics"] == {"sum": (1 + 2) * x, "world": 2, "ntasks": 2}
        assert p["slurm_job_id"] and Path(p["run_dir"]).parent == Path(s["sweep_dir"])
    assert "RuntimeError: point x=3 fails on purpose" == s["points"][2]["error"]
    # both tasks of a point ran (one submitit log per task), but only rank 0 wrote point.json
    job_dirs = [d for d in (Path(s["sweep_dir"]) / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", d.name)]
    assert len(job_dirs) == 3 and all(len(list(d.glob("*_log.out"))) == 2 for d in job_dirs)


REQUEUE_TASK = """\
def task(cfg):
    import json
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    rank, restarts = int(os.environ["SLURM_PROCID"]), int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts == 0:
        if rank == 0:  # what a trainer's checkpoint would be
            (run_dir / "state.json").write_text(json.dumps({"partial": 10 * cfg.x, "job": os.environ["SLURM_JOB_ID"]}))
            (run_dir / "waiting").write_text("signal me")
        for _ in range(480):  # until SLURM preempts us (USR2 -> submitit checkpoints and requeues the job)
            time.sleep(0.5)
        raise RuntimeError("was not requeued")
    state = json.loads((run_dir / "state.json").read_text())
    return {"partial": state["partial"], "restarts": restarts, "same_job": int(state["job"] == os.environ["SLURM_JOB_ID"])}
"""


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_preempted_point_is_requeued_into_the_same_run_dir(tmp_path):
    script = write_app(tmp_path / "app", REQUEUE_TASK, name="requeue_app")
    root = tmp_path / "sweeps"
    proc = kdexp_popen(["-m", "x=7", "hydra/launcher=slurm_cpu", "hydra.launcher.timeout_min=10"], app_env(root),
                       script.parent, entry=str(script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for(what, condition, timeout_s=300.0):
        deadline = time.monotonic() + timeout_s
        while not condition():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"waiting for {what}: sweep exited or {timeout_s}s passed\n{proc.communicate()[0]}"
                            f"\n{_diagnostics(root)}")
            time.sleep(0.5)

    try:
        wait_for("the first attempt", lambda: bool(list(root.glob("*/*/0/waiting"))))
        run_dir = next(root.glob("*/*/0"))
        job = json.loads((run_dir / "point.json").read_text())["slurm_job_id"]
        # What SLURM sends before a time limit or on preemption (submitit's --signal=USR2@signal_delay_s).
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=60)

        def requeued_and_done():
            # SLURM holds a requeued job for ~2 minutes (BeginTime); let it start now.
            reason = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True).stdout
            if "BeginTime" in reason:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
            return proc.poll() is not None

        wait_for("the requeued attempt", requeued_and_done)
        out = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        _cancel_jobs(root)
    assert proc.returncode == 0, out + _diagnostics(root)
    s = load_sweep(root)
    (p,) = s["points"]
    assert p["status"] == "finished" and p["attempt"] == 2
    assert Path(p["run_dir"]) == run_dir.resolve()
    assert p["metrics"] == {"partial": 70, "restarts": 1, "same_job": 1}
    assert len(sweep_dirs(root)) == 1


# --- the trainer: a TP=2 sweep on SLURM reproduces the TP=1 sweep of the basic launcher ------------------------------
TRAIN_POINTS = ["loss=topk,top_p", "balancer.alpha=0.5,1.0"]
TRAIN_ARGS = ["experiment=smoke", "logger=none", "trainer.max_steps=3", "trainer.reuse_finished=false"]
# Compared between TP=2 and TP=1: everything the run reports except throughput.
COMPARED = ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/loss", "train/kept_mass",
            "train/ghost_mass", "train/nucleus_size")


def _kdexp_sweep(workdir: Path, sweep_dir: Path, extra: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = app_env(workdir, KDEXP_CACHE=str(workdir / "cache"))  # both sweeps share it: one teacher pretraining
    env.pop("KDEXP_RUN_STAMP", None)  # each sweep draws its own stamp
    workdir.mkdir(parents=True, exist_ok=True)
    return kdexp_run(["-m", *TRAIN_ARGS, *TRAIN_POINTS, *extra, f"hydra.sweep.dir={sweep_dir}"], env, workdir,
                     check=False, timeout=timeout)


def _finals(sweep_dir: Path) -> dict:
    s = json.loads((sweep_dir / "sweep.json").read_text())
    out = {}
    for p in s["points"]:
        assert p["status"] == "finished", p
        summary = json.loads((Path(p["run_dir"]) / "summary.json").read_text())
        assert p["metrics"] == summary["final"]
        key = tuple(sorted(o for o in p["overrides"] if o.split("=")[0] in ("loss", "balancer.alpha")))
        out[key] = summary["final"]
    return out


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_trainer_sweep_tp2_on_slurm_matches_tp1_basic_launcher(tmp_path, seeded_cache):
    slurm_dir, basic_dir = tmp_path / "slurm_tp2", tmp_path / "basic_tp1"
    seeded_cache(tmp_path / "w" / "cache")  # both sweeps' cache: the smoke teacher already pretrained
    try:
        r = _kdexp_sweep(tmp_path / "w", slurm_dir, ["parallel.tensor=2", "hydra/launcher=slurm_cpu",
                                                     "hydra.launcher.timeout_min=20"], timeout=900)
    except AssertionError as e:  # past its timeout: killed, its output in e
        pytest.fail(f"SLURM sweep did not end in 900 s: {e}\n{_diagnostics(tmp_path)}")
    finally:
        _cancel_jobs(slurm_dir)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    b = _kdexp_sweep(tmp_path / "w", basic_dir, ["parallel.tensor=1"], timeout=900)
    assert b.returncode == 0, b.stdout[-5000:] + b.stderr[-5000:]
    tp2, tp1 = _finals(slurm_dir), _finals(basic_dir)
    assert len(tp1) == 4 and tp2.keys() == tp1.keys()
    worst = max(abs(tp2[k][m] - tp1[k][m]) / max(abs(tp1[k][m]), 1e-12)
                for k in tp1 for m in COMPARED if tp1[k].get(m) is not None)
    print(f"TP=2 (SLURM) vs TP=1 (basic launcher): largest relative difference {worst:.2e}")
    for key in tp1:
        assert tp2[key].keys() == tp1[key].keys()
        for metric in (m for m in COMPARED if tp1[key].get(m) is not None):
            assert tp2[key][metric] == pytest.approx(tp1[key][metric], rel=5e-4, abs=1e-5), (key, metric)
    # each SLURM point ran 2 tasks
    for d in (slurm_dir / ".submitit").iterdir():
        if re.fullmatch(r"\d+_\d+", d.name):
            assert len(list(d.glob("*_log.out"))) == 2


# --- the trainer preempted: USR2 (what SLURM sends signal_delay_s before the time limit) on a running TP=2 job --------
@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_usr2_on_a_training_job_saves_that_step_and_the_requeued_job_resumes_it(tmp_path):
    workdir, sweep_dir = tmp_path / "w", tmp_path / "sweep"
    workdir.mkdir()
    env = app_env(workdir, KDEXP_CACHE=str(workdir / "cache"), WANDB_MODE="offline")
    env.pop("KDEXP_RUN_STAMP", None)
    steps = 30  # no periodic checkpoint and eval only at the end: the only checkpoint is the one USR2 asks for
    proc = kdexp_popen(["-m", "experiment=smoke", "model.embedded_teacher=shipped", "logger=none",
                        f"trainer.max_steps={steps}", f"trainer.eval_interval={steps}",
                        f"trainer.checkpoint_interval={steps}", "parallel.tensor=2", "hydra/launcher=slurm_cpu",
                        "hydra.launcher.timeout_min=20", f"hydra.sweep.dir={sweep_dir}"], env, workdir,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = sweep_dir / "0"

    def trained_steps() -> list[int]:
        path = run_dir / "metrics.jsonl"
        out = []
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the line being written
                continue
            if record["kind"] == "train":
                out.append(record["step"])
        return out

    def wait_for(what, condition, timeout_s=600.0):
        deadline = time.monotonic() + timeout_s
        while not condition():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"waiting for {what}: sweep exited or {timeout_s}s passed\n{proc.communicate()[0]}"
                            f"\n{_diagnostics(sweep_dir)}")
            time.sleep(0.2)

    try:
        wait_for("step 2 of the first attempt", lambda: len(trained_steps()) >= 2)
        job = json.loads((run_dir / "point.json").read_text())["slurm_job_id"]
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=60)

        def requeued_and_done():
            reason = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True).stdout
            if "BeginTime" in reason:  # SLURM holds a requeued job for ~2 minutes; let it start now
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
            return proc.poll() is not None

        wait_for("the requeued attempt", requeued_and_done)
        out = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        _cancel_jobs(sweep_dir)
    assert proc.returncode == 0, out[-5000:] + _diagnostics(sweep_dir)
    log = (run_dir / "run.log").read_text()
    m = re.search(r"preempted by SIGUSR2 after step (\d+)/30: checkpoint step \1 saved in .*; submitit requeues", log)
    assert m, log[-5000:]
    assert f"resuming from step {m[1]} " in log  # the requeued attempt starts right after the saved step
    assert trained_steps() == list(range(1, steps + 1))  # every step once: none redone, none lost
    (p,) = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    assert p["status"] == "finished" and p["attempt"] == 2 and p["slurm_job_id"] == job
