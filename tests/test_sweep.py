"""Sweep semantics (kdexp.track.sweep) and the launcher presets, without training.

The multirun tests run a throwaway Hydra app (tests/_sweep_apps.py) whose task fails for one point, with Hydra's basic
launcher and with submitit_local, and check that every other point finishes and sweep.json lists all of them.
"""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from _sweep_apps import CONF_DIR, app_env, load_sweep, run_app, sweep_dirs, write_app
import kdexp.launchers
from kdexp.track import records, sweep
from sweeps import run_diverging_sweep

# A task whose result the test recomputes independently: score = 1.5 * x, and x == 2 fails.
SCORE_TASK = """\
def task(cfg):
    if cfg.x == 2:
        raise RuntimeError(f"boom for x={cfg.x}")
    return {"val/score": 1.5 * cfg.x, "note": "not a number, not a metric"}
"""


# --- kdexp_uid ------------------------------------------------------------------------------------------------------
def test_uid_is_stable_within_a_process_and_shared_by_interpolations():
    cfg = OmegaConf.create({"a": "run/${kdexp_uid:}", "b": "${kdexp_uid:}", "c": "${a}-x"})
    uid = sweep.sweep_uid()
    assert len(uid) == 6 and int(uid, 16) >= 0
    assert cfg.a == f"run/{uid}" and cfg.b == uid and cfg.c == f"run/{uid}-x"
    assert OmegaConf.create({"d": "${kdexp_uid:}"}).d == uid  # another config in the same process agrees


def test_uid_differs_between_processes():
    code = "import kdexp.track.sweep as s; from omegaconf import OmegaConf; print(OmegaConf.create({'u': '${kdexp_uid:}'}).u)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    uids = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(len(u) == 6 for u in uids)
    assert len(set(uids)) == len(uids), uids


def test_two_sweeps_started_together_get_their_own_dirs(tmp_path):
    # The sweep dir below has no time component at all, only the date and kdexp_uid: if the uid did not separate them,
    # two sweeps started in the same second (here: at the same moment) would share a directory.
    script = write_app(tmp_path / "app", SCORE_TASK)
    root = tmp_path / "sweeps"
    procs = [subprocess.Popen([sys.executable, str(script), "-m", f"x={a},{b}"], cwd=script.parent,
                              env=app_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for a, b in ((1, 3), (4, 5))]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    dirs = sweep_dirs(root)
    assert len(dirs) == 2 and dirs[0] != dirs[1]
    seen = set()
    for d in dirs:
        s = json.loads((d / "sweep.json").read_text())
        xs = tuple(sorted(int(p["overrides"][0].split("=")[1]) for p in s["points"]))
        seen.add(xs)
        for p in s["points"]:
            assert Path(p["run_dir"]).parent == d and p["status"] == "finished"
    assert seen == {(1, 3), (4, 5)}


# --- point.json / sweep.json -------------------------------------------------------------------------------------------
def _fail_here(msg):
    raise ValueError(msg)


def test_point_and_sweep_json_with_a_failure(tmp_path):
    sweep_dir = tmp_path / "sw"
    plan = [["loss=topk", "balancer.alpha=0.5"], ["loss=topk", "balancer.alpha=1.0"],
            ["loss=top_p", "balancer.alpha=0.5"], ["loss=top_p", "balancer.alpha=1.0"]]
    sweep_dir.mkdir()
    (sweep_dir / "sweep.json").write_text(json.dumps({"sweep_dir": str(sweep_dir), "total": 4, "points": [
        {"num": i, "overrides": o, "run_dir": None, "status": "pending", "metrics": {}, "error": None}
        for i, o in enumerate(plan)]}))
    sweep.record_point(sweep_dir / "0", "finished", metrics={"val/lm_loss": 2.5}, num=0, overrides=plan[0])
    sweep.record_point(sweep_dir / "1", "running", num=1, overrides=plan[1])
    try:
        _fail_here("loss exploded at step 3")
    except ValueError as exc:
        (sweep_dir / "2").mkdir()
        sweep.record_point(sweep_dir / "2", "running", num=2, overrides=plan[2])
        sweep.record_failure(sweep_dir / "2", exc)
    # a checkpoint dir holding a stray point.json is not a point
    (sweep_dir / "0" / "checkpoints" / "step_2").mkdir(parents=True)
    (sweep_dir / "0" / "checkpoints" / "step_2" / "point.json").write_text("{}")

    s = sweep.rebuild_sweep(sweep_dir)
    assert json.loads((sweep_dir / "sweep.json").read_text()) == s
    assert [p["num"] for p in s["points"]] == [0, 1, 2, 3]
    assert [p["status"] for p in s["points"]] == ["finished", "running", "failed", "pending"]
    assert [p["overrides"] for p in s["points"]] == plan
    assert s["counts"] == {"pending": 1, "running": 1, "finished": 1, "reused": 0, "failed": 1, "diverged": 0,
                           "interrupted": 0}
    assert s["points"][0]["metrics"] == {"val/lm_loss": 2.5}
    assert s["points"][0]["run_dir"] == str((sweep_dir / "0").resolve())
    failed = s["points"][2]
    assert failed["error"] == "ValueError: loss exploded at step 3"
    for log in ("error.log", "run.log"):
        text = (sweep_dir / "2" / log).read_text()
        assert "Traceback (most recent call last)" in text and "_fail_here" in text
        assert "ValueError: loss exploded at step 3" in text
    assert json.loads((sweep_dir / "2" / "point.json").read_text())["status"] == "failed"
    assert sweep.progress_line(s) == (f"[sweep] 1/4 done, 1 running, 1 failed, 0 diverged - report: "
                                      f"python -m kdexp.report {sweep_dir.resolve()}")


def test_record_point_rejects_unknown_status_and_only_rank0_writes(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="status='done'.*pending, running, finished, reused, failed, diverged"):
        sweep.record_point(tmp_path / "r", "done")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sweep.record_point(tmp_path / "r1", "finished") is None
    assert sweep.record_failure(tmp_path / "r1", RuntimeError("x")) is None
    assert not (tmp_path / "r1").exists()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_PROCID", "1")  # an srun step's second task: not the writer either
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert sweep.record_point(tmp_path / "r1", "finished") is None and not (tmp_path / "r1").exists()
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert sweep.record_point(tmp_path / "r0", "finished")["status"] == "finished"


def test_record_failure_of_a_diverged_point_keeps_its_own_error_log(tmp_path):
    run_dir = tmp_path / "sw" / "1"
    final = {"train/loss": 1.75, "val/lm_loss": float("nan")}
    records.write_json(run_dir / records.SUMMARY, {"status": "diverged", "step": 3, "final": final,
                                                   "error": "diverged at step 3: non-finite train/grad_norm"})
    (run_dir / records.ERROR_LOG).write_text("the point's own error log\n")
    sweep.record_point(run_dir, "running", num=1, overrides=["trainer.lr=1e6"])
    try:
        _fail_here("diverged at step 3")
    except ValueError as exc:
        point = sweep.record_failure(run_dir, exc)
    assert (run_dir / records.ERROR_LOG).read_text() == "the point's own error log\n"  # not overwritten
    assert not (run_dir / records.RUN_LOG).exists()  # the point's own record stands for run.log too
    on_disk = records.read_json(run_dir / records.POINT)
    assert on_disk == point and point["status"] == "diverged" and point["step"] == 3
    assert point["error"] == "diverged at step 3: non-finite train/grad_norm"  # the summary's message
    assert point["metrics"]["train/loss"] == 1.75 and math.isnan(point["metrics"]["val/lm_loss"])
    assert '"val/lm_loss": "NaN"' in (run_dir / records.POINT).read_text()  # strict JSON on disk
    # without an error.log of its own, the callback writes one (and appends the same to run.log)
    (run_dir / records.ERROR_LOG).unlink()
    try:
        _fail_here("diverged at step 3")
    except ValueError as exc:
        sweep.record_failure(run_dir, exc)
    text = (run_dir / records.ERROR_LOG).read_text()
    assert text.splitlines()[0].endswith("point diverged on " + socket.gethostname())
    assert "_fail_here" in text and text in (run_dir / records.RUN_LOG).read_text()
    assert sweep.rebuild_sweep(tmp_path / "sw")["counts"]["diverged"] == 1


@pytest.mark.slow
def test_real_sweep_with_a_diverging_point(tmp_path):
    from kdexp.report import load_sweep as load_report, points_table, to_markdown

    sweep_dir = tmp_path / "sw"
    proc = run_diverging_sweep(sweep_dir, index_dir=tmp_path / "points")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the sweep ran to the end, then says through its exit status: not all well
    s = json.loads((sweep_dir / "sweep.json").read_text())
    assert [(p["num"], p["status"]) for p in s["points"]] == [(0, "finished"), (1, "diverged")], out
    assert s["counts"] == {"pending": 0, "running": 0, "finished": 1, "reused": 0, "failed": 0, "diverged": 1,
                           "interrupted": 0}
    summaries = [json.loads((sweep_dir / str(n) / "summary.json").read_text()) for n in (0, 1)]
    assert [x["status"] for x in summaries] == ["finished", "diverged"]
    for p, summary in zip(s["points"], summaries):
        assert json.loads((sweep_dir / str(p["num"]) / "point.json").read_text())["status"] == p["status"]
        assert p["metrics"] == summary["final"]  # the diverged point's: its last finite metrics
    diverged, bad = s["points"][1], summaries[1]
    assert bad["step"] == 3 and bad["checkpoint"] == 2 and diverged["error"] == bad["error"]
    assert bad["error"].startswith("diverged at step 3: non-finite")
    error_log = (sweep_dir / "1" / "error.log").read_text()
    assert error_log.count(" point diverged on ") == 1 and f"kdexp.train.errors.Diverged: {bad['error']}" in error_log
    assert not (sweep_dir / "0" / "error.log").exists()
    assert "[sweep] 1/2 done, 0 running, 0 failed, 1 diverged" in out
    assert "[sweep] ended: 1 finished, 0 reused, 0 failed, 1 diverged, 0 not finished, of 2" in out
    assert f"[sweep] diverged #1: trainer.lr=1000000.0: {bad['error']}" in out  # the plan names it as Hydra parsed it

    # the report: status diverged, the numbers of each summary.json, steps = where it stopped
    table = points_table(load_report(sweep_dir))
    rows = table.records()
    assert [r["status"] for r in rows] == ["finished", "diverged"] and rows[1]["error"] == bad["error"]
    for row, summary in zip(rows, summaries):
        for metric in ("val/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "train/kept_mass"):
            assert row[metric] == summary["final"][metric], metric
    assert [r["steps"] for r in rows] == [4, 3]
    assert "| diverged (last finite values) |" in to_markdown(table)


# --- naming -------------------------------------------------------------------------------------------------------------
def test_run_name_and_sweep_keys():
    o = ["trainer.max_steps=4", "loss.top_p=0.9", "balancer.alpha=0.5", "hydra.launcher.partition=x"]
    assert sweep.run_name(o) == "trainer.max_steps=4,loss.top_p=0.9,balancer.alpha=0.5"
    assert sweep.run_name(o, keys=["balancer.alpha", "loss.top_p"]) == "loss.top_p=0.9,balancer.alpha=0.5"
    assert sweep.run_name([]) == "defaults"
    points = [["trainer.max_steps=4", "loss=topk", "balancer.alpha=0.5"],
              ["trainer.max_steps=4", "loss=topk", "balancer.alpha=1.0"],
              ["trainer.max_steps=4", "loss=top_p", "balancer.alpha=0.5", "+loss.min_k=2"]]
    assert sweep.sweep_keys(points) == ["loss", "balancer.alpha", "loss.min_k"]
    assert sweep.override_key("+loss.min_k=2") == "loss.min_k" and sweep.override_key("~logger") == "logger"


def test_wandb_group_and_job_type():
    multi = {"hydra": {"mode": "MULTIRUN", "sweep": {"dir": "multirun/2026-12-02/17-34-40-ab12cd"},
                       "overrides": {"task": ["balancer.alpha=0.5"]}}}
    single = {"hydra": {"mode": "RUN", "sweep": {"dir": "multirun/x"}, "overrides": {"task": []}}}
    assert sweep.wandb_group(multi) == "2026-12-02_17-34-40-ab12cd"
    assert sweep.wandb_group(OmegaConf.create(multi).hydra) == "2026-12-02_17-34-40-ab12cd"
    assert sweep.wandb_group(Path("/somewhere/my-sweep")) == "my-sweep"
    assert sweep.wandb_group(single) is None
    assert sweep.job_type(multi) == "sweep" and sweep.job_type(single) == "run"
    assert sweep.wandb_names(single) == {"group": None, "name": "defaults", "job_type": "run"}


# --- multirun with a failing point ---------------------------------------------------------------------------------------
def _check_scores_sweep(root: Path, xs: list[int], out: str) -> None:
    s = load_sweep(root)
    assert len(s["points"]) == len(xs) and s["total"] == len(xs)
    for num, (p, x) in enumerate(zip(s["points"], xs)):
        assert p["num"] == num and p["overrides"] == [f"x={x}"]
        assert Path(p["run_dir"]).parent == Path(s["sweep_dir"])
        if x == 2:
            assert p["status"] == "failed" and p["error"] == "RuntimeError: boom for x=2"
            err = (Path(p["run_dir"]) / "error.log").read_text()
            assert "Traceback" in err and "boom for x=2" in err
        else:
            assert p["status"] == "finished" and p["error"] is None
            assert p["metrics"] == {"val/score": 1.5 * x}
        assert json.loads((Path(p["run_dir"]) / "point.json").read_text())["status"] == p["status"]
    assert f"[sweep] {len(xs)} points -> {s['sweep_dir']}" in out
    assert f"report: python -m kdexp.report {s['sweep_dir']}" in out
    assert f"[sweep] ended: {len(xs) - 1} finished, 0 reused, 1 failed, 0 diverged" in out


def test_basic_launcher_failing_point_does_not_stop_the_others(tmp_path):
    script = write_app(tmp_path / "app", SCORE_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1,2,3"], root)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # the sweep ran to the end, then reports the failed point through its exit status
    _check_scores_sweep(root, [1, 2, 3], out)
    assert "[sweep] 1/3 done, 0 running, 0 failed, 0 diverged" in out
    assert "[sweep] 2/3 done, 0 running, 1 failed, 0 diverged" in out


def test_submitit_local_failing_point_does_not_stop_the_others(tmp_path):
    script = write_app(tmp_path / "app", SCORE_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1,2", "hydra/launcher=local_cpu"], root)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    _check_scores_sweep(root, [1, 2], out)
    # the workers ran in their own processes (submitit logs) and resolved the submitting process's sweep dir
    assert list((Path(load_sweep(root)["sweep_dir"]) / ".submitit").glob("*/*_log.out"))


def test_keep_going_false_stops_like_plain_hydra(tmp_path):
    script = write_app(tmp_path / "app", SCORE_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=2,3", "+hydra.callbacks.sweep.keep_going=false"], root)
    assert r.returncode == 1
    s = load_sweep(root)
    # Hydra's basic sweeper re-raises the failure after the batch: on_multirun_end never runs, yet each job's record
    # is there.
    assert [p["status"] for p in s["points"]] == ["failed", "finished"]
    assert "[sweep] ended" not in r.stdout


# --- launcher presets and the site file ----------------------------------------------------------------------------------
def _launcher(tmp_path, monkeypatch, overrides, site_yaml=None):
    from hydra import compose, initialize_config_dir

    app = write_app(tmp_path / "app", SCORE_TASK).parent
    monkeypatch.setenv("SWEEP_ROOT", str(tmp_path / "sweeps"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KDEXP_SITE_DIR", raising=False)
    if site_yaml is not None:
        (tmp_path / "site" / "site").mkdir(parents=True)
        (tmp_path / "site" / "site" / "local.yaml").write_text(site_yaml)
        monkeypatch.setenv("KDEXP_SITE_DIR", str(tmp_path / "site"))
    with initialize_config_dir(config_dir=str(app), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    return cfg.hydra.launcher


def test_presets(tmp_path, monkeypatch):
    gpu = _launcher(tmp_path, monkeypatch, ["hydra/launcher=slurm_gpu"])
    assert gpu._target_.endswith("SlurmLauncher")
    assert gpu.tasks_per_node == gpu.gpus_per_node == 8
    assert gpu.max_num_timeout > 0 and gpu.additional_parameters.requeue is True
    assert gpu.partition is None and gpu.account is None
    assert f"export OMP_NUM_THREADS={gpu.cpus_per_task}" in gpu.setup
    cpu = _launcher(tmp_path / "b", monkeypatch, ["hydra/launcher=slurm_cpu"])
    assert cpu.tasks_per_node == 2 and not cpu.gpus_per_node and cpu.max_num_timeout > 0
    local = _launcher(tmp_path / "c", monkeypatch, ["hydra/launcher=local_cpu"])
    assert local._target_.endswith("LocalLauncher")
    assert sorted(p.name for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml")) == [
        "local_cpu.yaml", "slurm_cpu.yaml", "slurm_gpu.yaml"]


def test_site_file_sets_partition_and_account(tmp_path, monkeypatch):
    site = "partition: gpu\naccount: my_project\nsetup:\n  - module load cuda\n"
    gpu = _launcher(tmp_path, monkeypatch, ["hydra/launcher=slurm_gpu"], site)
    assert (gpu.partition, gpu.account, list(gpu.setup)) == ("gpu", "my_project", ["module load cuda"])
    assert gpu.tasks_per_node == 8  # the preset's own keys stay
    cli = _launcher(tmp_path / "b", monkeypatch, ["hydra/launcher=slurm_cpu", "hydra.launcher.partition=other"], site)
    assert (cli.partition, cli.account) == ("other", "my_project")


def test_site_dir_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_SITE_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="KDEXP_SITE_DIR=.*missing.*not a directory"):
        from kdexp.launchers.site import site_searchpath

        site_searchpath()


def test_site_example_is_valid_for_the_slurm_presets(tmp_path, monkeypatch):
    example = (Path(kdexp.launchers.__file__).parent / "site.yaml.example").read_text()
    gpu = _launcher(tmp_path, monkeypatch, ["hydra/launcher=slurm_gpu"], example)
    assert gpu.partition == "gpu" and gpu.account == "my_project"


def test_relative_sweep_dir_and_job_chdir(tmp_path):
    # hydra.job.chdir moves each job into its run dir before the callback runs: the relative sweep dir must still be
    # the one under the directory the sweep was started from.
    script = write_app(tmp_path / "app", SCORE_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1,3", "hydra.job.chdir=true", "hydra.sweep.dir=rel/${kdexp_uid:}"], root)
    assert r.returncode == 0, r.stdout + r.stderr
    (sweep_json,) = script.parent.rglob("sweep.json")  # and none inside a run dir
    s = json.loads(sweep_json.read_text())
    assert s["sweep_dir"] == str(sweep_json.parent)
    assert [(p["status"], Path(p["run_dir"]).parent) for p in s["points"]] == [("finished", sweep_json.parent)] * 2


def test_launchers_cli_names_the_site_file(tmp_path):
    (tmp_path / "site").mkdir()
    env = app_env(tmp_path, KDEXP_SITE_DIR=str(tmp_path / "site"))
    r = subprocess.run([sys.executable, "-m", "kdexp.launchers", "site"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"site dir: {(tmp_path / 'site').resolve()}" in r.stdout
    assert f"site file: {(tmp_path / 'site' / 'site' / 'local.yaml').resolve()} (absent)" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kdexp.launchers", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "start-slurm" in bad.stderr
