"""Run records that cannot lie under faults (issue 37, and 35's refused runs), each from real kdexp.run processes, each
asserting the records afterwards: every step logged once, every label what the point trained, every status final.

- a refused run (a bad value, a run dir of another config) leaves nothing on disk and changes no byte of that dir;
- a finished sweep rerun into its own sweep dir with its values swapped is refused point by point, byte for byte;
- two runs into one run dir: the second is refused with the holder's pid and host, the first trains every step once;
- a sweep driver killed with -9 and rerun at once: its orphaned worker keeps the point, the rerun is refused there.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from _launch import kdexp_popen, kdexp_run
from _zygote import alive
from kdexp.report.rundirs import load_point, load_sweep

pytestmark = pytest.mark.slow

# seconds a run: the shipped teacher (no pretraining), no W&B
SMOKE = ["experiment=smoke", "model.embedded_teacher=shipped", "logger=none"]
PIPED = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}  # a live run's output, read as text



def tree(root: Path) -> dict[str, bytes]:
    """Every file below root, by relative path, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def steps(run_dir: Path, kind: str) -> list[int]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["step"] for x in lines if x["kind"] == kind]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def wait_for(what, timeout: float = 300, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"not seen within {timeout} s: {what}")


def test_a_refused_run_leaves_nothing_on_disk_and_changes_no_byte_of_a_dir_it_was_refused(env, tmp_path):
    new = tmp_path / "outputs" / "day" / "run"
    bad = kdexp_run([*SMOKE, "balancer.alpha=1.5", f"hydra.run.dir={new}"], env, tmp_path, check=False, timeout=600)
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "kdexp: error: balancer.alpha=1.5 is invalid: must be a number in [0, 1]"]
    assert not (tmp_path / "outputs").exists()  # no run dir, no error.log, not even the dirs made for it

    run_dir = tmp_path / "run"
    base = [*SMOKE, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    assert kdexp_run([*base, "balancer.alpha=0.5"], env, tmp_path, check=False, timeout=600).returncode == 0
    before = tree(run_dir)
    refused = kdexp_run([*base, "balancer.alpha=0.9"], env, tmp_path, check=False, timeout=600)
    assert refused.returncode == 2
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"kdexp: error: {run_dir} holds the run of another config")
    assert tree(run_dir) == before  # .hydra/ and run.log included: the labels still say what was trained
    point = load_point(run_dir)
    assert point.status == "finished" and point.overrides["balancer.alpha"] == "0.5" and point.steps == 2
    assert [p.name for p in load_sweep(tmp_path).points] == ["run"]  # the refused runs are no points


def test_a_finished_sweep_rerun_with_its_values_swapped_is_refused_byte_for_byte(env, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *SMOKE, f"hydra.sweep.dir={sweep}"]
    first = kdexp_run([*args, "trainer.max_steps=2,3"], env, tmp_path, check=False, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {n: tree(sweep / n) for n in ("0", "1")}
    second = kdexp_run([*args, "trainer.max_steps=3,2"], env, tmp_path, check=False, timeout=600)
    assert second.returncode == 1
    assert "Traceback" not in second.stdout + second.stderr
    assert {n: tree(sweep / n) for n in ("0", "1")} == before  # no byte of either point changed
    ended = [x for x in second.stdout.splitlines() if x.startswith("[sweep] ")]
    assert any("2 finished, 0 reused, 0 failed, 0 diverged, 0 not finished, 2 refused, of 2" in x for x in ended)
    for num, steps_ in ((0, 3), (1, 2)):
        [told] = [x for x in ended if x.startswith(f"[sweep] refused #{num}: trainer.max_steps={steps_}: ")]
        assert "holds the run of another config" in told
    # every label is what its point trained: point 0 is still the 2-step run, point 1 the 3-step one
    points = sorted(load_sweep(sweep).points, key=lambda p: p.num)
    assert [(p.num, p.overrides["trainer.max_steps"], p.steps, p.status) for p in points] == [
        (0, "2", 2, "finished"), (1, "3", 3, "finished")]
    assert [steps(sweep / n, "train") for n in ("0", "1")] == [[1, 2], [1, 2, 3]]
    recorded = json.loads((sweep / "sweep.json").read_text())
    assert [(p["num"], p["status"], p["overrides"][-1]) for p in recorded["points"]] == [
        (0, "finished", "trainer.max_steps=2"), (1, "finished", "trainer.max_steps=3")]
    assert sorted(r["num"] for r in recorded["refused"]) == [0, 1]


def test_two_runs_into_one_run_dir_the_second_is_refused_naming_the_first(env, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMOKE, "trainer.max_steps=8", "trainer.checkpoint_interval=4", "trainer.eval_interval=4",
            f"hydra.run.dir={run_dir}"]
    first = kdexp_popen(args, env, tmp_path, **PIPED)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file())  # the first run trains
        first.send_signal(signal.SIGSTOP)  # and holds the dir, however fast it trains
        try:
            second = kdexp_run(args, env, tmp_path, check=False, timeout=600)
        finally:
            first.send_signal(signal.SIGCONT)
        out, _ = first.communicate(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 0, out[-3000:]
    assert second.returncode == 2
    [line] = second.stderr.splitlines()
    assert line.startswith(f"kdexp: error: {run_dir} is in use by the run of pid {first.pid} on host "
                           f"{socket.gethostname()} since ")
    assert line.endswith(": not run twice into one run dir; wait for that run to end (or stop it), then rerun")
    assert steps(run_dir, "train") == list(range(1, 9)) and steps(run_dir, "val") == [4, 8]  # each step once
    assert summary(run_dir)["status"] == "finished" and summary(run_dir)["steps"] == 8
    before = tree(run_dir)
    # the first run ended: its lock went with it, and it is finished
    after = kdexp_run(args, env, tmp_path, check=False, timeout=600)
    assert after.returncode == 0 and "already finished" in after.stdout + after.stderr
    assert {k: v for k, v in tree(run_dir).items() if k not in ("run.log", ".kdexp.lock")} == \
        {k: v for k, v in before.items() if k not in ("run.log", ".kdexp.lock")}


def test_a_killed_sweep_driver_rerun_at_once_never_trains_a_point_twice(env, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *SMOKE, "hydra/launcher=local_cpu", "trainer.max_steps=10", "trainer.eval_interval=5",
            "trainer.checkpoint_interval=5", "balancer.alpha=0.5", f"hydra.sweep.dir={sweep}"]
    point = sweep / "0"
    with open(tmp_path / "driver.log", "w") as log:  # submitit's job controller outlives the driver: not a pipe
        driver = kdexp_popen(args, env, tmp_path, stdout=log, stderr=subprocess.STDOUT)
    worker = None
    try:
        wait_for(lambda: (point / "metrics.jsonl").is_file())
        worker = json.loads((point / "point.json").read_text())["pid"]
        os.kill(worker, signal.SIGSTOP)  # the orphan holds the point, however fast it trains
    finally:
        driver.kill()
        driver.wait()
    try:
        assert alive(worker)
        rerun = kdexp_run(args, env, tmp_path, check=False, timeout=600)
    finally:
        os.kill(worker, signal.SIGCONT)  # the orphan trains on
    assert rerun.returncode == 1
    assert f"is in use by the run of pid {worker} on host {socket.gethostname()}" in rerun.stdout + rerun.stderr
    assert "Traceback" not in rerun.stdout + rerun.stderr
    wait_for(lambda: not alive(worker), timeout=600, poll=0.5)
    assert steps(point, "train") == list(range(1, 11)) and steps(point, "val") == [5, 10]  # each step once
    assert summary(point)["status"] == "finished"
    assert json.loads((point / "point.json").read_text())["status"] == "finished"
    # now the point is finished: counted, not retrained
    again = kdexp_run(args, env, tmp_path, check=False, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    assert steps(point, "train") == list(range(1, 11))
    recorded = json.loads((sweep / "sweep.json").read_text())
    assert [p["status"] for p in recorded["points"]] == ["finished"] and not recorded["refused"]


FAULT_RUN = str(Path(__file__).with_name("_fault_run.py"))  # kdexp.run that SIGKILLs itself after a given step


def cut(path: Path, keep) -> None:
    """metrics.jsonl keeping the lines whose step `keep` accepts, and a half line at the end (a cut write)."""
    lines = [x for x in path.read_text().splitlines() if keep(json.loads(x)["step"])]
    path.write_text("".join(x + "\n" for x in lines) + '{"step": 9, "kind": "tr')


def test_a_resume_over_a_cut_metrics_file_says_so_and_logs_every_step_once(env, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMOKE, "trainer.max_steps=6", "trainer.checkpoint_interval=2", f"hydra.run.dir={run_dir}"]
    killed = kdexp_run(args, env, tmp_path, check=False, timeout=600, kill_at=5)
    assert killed.returncode == -9 and (run_dir / "checkpoints" / "latest").read_text().strip() == "4"
    cut(run_dir / "metrics.jsonl", lambda step: step <= 1)  # the record lost steps 2-5; the weights are at step 4
    rerun = kdexp_run(args, env, tmp_path, check=False, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    [told] = [x for x in (rerun.stdout + rerun.stderr).splitlines() if "not resuming from checkpoint step 4" in x]
    assert told.endswith(f"of {run_dir}: its metrics.jsonl lacks the train lines of steps 2-4 and the val lines of "
                         "steps 3; training from step 0, so that every step is logged once")
    assert steps(run_dir, "train") == [1, 2, 3, 4, 5, 6] and steps(run_dir, "val") == [3, 6]
    assert summary(run_dir)["status"] == "finished" and summary(run_dir)["steps"] == 6


def test_a_finished_point_with_a_hole_in_its_record_is_neither_reused_nor_resumed(env, tmp_path):
    args = ["-m", *SMOKE, "trainer.max_steps=4", "balancer.alpha=0.3"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert kdexp_run([*args, f"hydra.sweep.dir={first}"], env, tmp_path, check=False, timeout=600).returncode == 0
    cut(first / "0" / "metrics.jsonl", lambda step: step != 2)  # a hole, its last line still there
    rerun = kdexp_run([*args, f"hydra.sweep.dir={second}"], env, tmp_path, check=False, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    said = rerun.stdout + rerun.stderr
    assert f"not reusing {(first / '0').resolve()}: its metrics.jsonl lacks the train lines of steps 2" in said
    assert f"not resuming from checkpoint step 4 of {(first / '0').resolve()}: its metrics.jsonl lacks the train " \
           "lines of steps 2" in said
    point = second / "0"
    assert steps(point, "train") == [1, 2, 3, 4] and steps(point, "val") == [3, 4]  # trained here, every step once
    assert summary(point)["status"] == "finished" and summary(point)["reused_from"] is None
    assert json.loads((point / "point.json").read_text())["status"] == "finished"
    index = Path(env["KDEXP_CACHE"]) / "points" / f"{summary(point)['config_hash']}.json"
    assert json.loads(index.read_text())["run_dir"] == str(point.resolve())  # the index points at the whole record


def test_a_point_resumed_from_another_run_says_so_and_costs_only_what_it_trained(env, tmp_path):
    args = ["-m", *SMOKE, "trainer.max_steps=6", "trainer.checkpoint_interval=2", "balancer.alpha=0.7"]
    first, second = tmp_path / "first", tmp_path / "second"
    killed = kdexp_run([*args, f"hydra.sweep.dir={first}"], env, tmp_path, check=False, timeout=600, kill_at=5)
    assert killed.returncode == -9
    rerun = kdexp_run([*args, f"hydra.sweep.dir={second}"], env, tmp_path, check=False, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    done = summary(second / "0")
    assert done["status"] == "finished" and done["reused_from"] is None
    assert done["resumed_from"] == {"run_dir": str((first / "0").resolve()), "step": 4} and done["trained_steps"] == 2
    t = json.loads(json.dumps(load_point(second / "0").config["trainer"]))
    per_step = (t["global_batch_size"] or t["micro_batch_size"]) * t["seq_length"]  # one process: no DP
    assert done["cost"]["tokens"] == 2 * per_step  # the 2 steps trained here, not the 4 resumed
    assert steps(second / "0", "train") == [1, 2, 3, 4, 5, 6]


def test_a_point_whose_config_trains_in_another_live_sweep_waits_and_is_reused(env, tmp_path):
    args = ["-m", *SMOKE, "trainer.max_steps=4", "balancer.alpha=0.6"]
    first, second = tmp_path / "first", tmp_path / "second"
    a = kdexp_popen([*args, f"hydra.sweep.dir={first}"], env, tmp_path, **PIPED)
    try:
        wait_for(lambda: (first / "0" / "metrics.jsonl").is_file())
        a.send_signal(signal.SIGSTOP)  # the first sweep holds its point, mid-training
        b = kdexp_popen([*args, f"hydra.sweep.dir={second}"], env, tmp_path, **PIPED)
        try:
            seen = []
            for line in b.stdout:
                seen.append(line)
                if "waiting for the run of pid" in line:
                    break
            assert f"waiting for the run of pid {a.pid} on host {socket.gethostname()}" in seen[-1], "".join(seen)
        finally:
            a.send_signal(signal.SIGCONT)
        assert a.wait(timeout=600) == 0
        out = "".join(seen) + b.communicate(timeout=600)[0]
        assert b.returncode == 0, out[-3000:]
    finally:
        a.kill()
    mine, theirs = summary(second / "0"), summary(first / "0")
    assert mine["reused_from"] == str((first / "0").resolve()) and mine["final"] == theirs["final"]
    assert mine["cost"] == theirs["cost"]  # the cost of the training it reuses, none of its own
    assert json.loads((second / "0" / "point.json").read_text())["status"] == "reused"
    assert not (second / "0" / "checkpoints").exists()  # nothing trained here
    assert steps(second / "0", "train") == [1, 2, 3, 4]


def test_a_killed_sweep_with_a_pending_point_ends_interrupted_and_its_rerun_trains_every_step_once(env, tmp_path):
    from kdexp.report.live import watch

    sweep = tmp_path / "sweep"
    args = ["-m", *SMOKE, "hydra/launcher=local_cpu", "launch.local_parallel=1", "trainer.max_steps=20",
            "trainer.checkpoint_interval=5", "trainer.eval_interval=10", "balancer.alpha=0.2,0.4",
            f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "driver.log", "w") as log:
        driver = kdexp_popen(args, env, tmp_path, stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        def recorded():  # one point trains, the other waits for the one local slot
            got = {n: json.loads((sweep / n / "point.json").read_text())
                   for n in ("0", "1") if (sweep / n / "point.json").is_file()}
            states = sorted(p["status"] for p in got.values())
            return got if states == ["pending", "running"] and any(
                (sweep / n / "metrics.jsonl").is_file() for n in got) else None

        workers = [p["pid"] for p in wait_for(recorded).values()]
    finally:
        driver.kill()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)  # the sweep is gone: its driver and both workers
        driver.wait()
    wait_for(lambda: not any(alive(pid) for pid in workers))
    assert sorted(p.status for p in load_sweep(sweep).points) == ["interrupted", "interrupted"]
    files = watch(sweep, interval=0.01, max_polls=3, echo=lambda line: None)
    assert files is not None and not files.live  # report --watch ends on its first look
    rerun = kdexp_run(args, env, tmp_path, check=False, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    for n in ("0", "1"):
        assert steps(sweep / n, "train") == list(range(1, 21)) and steps(sweep / n, "val") == [10, 20]
        assert summary(sweep / n)["status"] == "finished"
    assert [p["status"] for p in json.loads((sweep / "sweep.json").read_text())["points"]] == ["finished"] * 2


def test_a_dead_worker_ends_its_sweep_with_the_end_lines_not_a_traceback(env, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *SMOKE, "hydra/launcher=local_cpu", "launch.local_parallel=2", "trainer.max_steps=12",
            "trainer.eval_interval=12", "trainer.checkpoint_interval=12", "balancer.alpha=0.25,0.35",
            f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "driver.log", "w") as log:
        driver = kdexp_popen(args, env, tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (sweep / "0" / "metrics.jsonl").is_file() or driver.poll() is not None)
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        os.kill(json.loads((sweep / "0" / "point.json").read_text())["pid"], signal.SIGKILL)
        assert driver.wait(timeout=600) == 1
    finally:
        driver.kill()
    out = (tmp_path / "driver.log").read_text()
    assert "Traceback" not in out and "UncompletedJobError" not in out.replace("(UncompletedJobError", "")
    assert "kdexp: error: point #0: its job " in out and "rerun the sweep to resume it" in out
    ended = [x for x in out.splitlines() if x.startswith("[sweep] ")]
    assert any("1 finished, 0 reused, 0 failed, 0 diverged, 0 not finished, 1 interrupted, of 2" in x for x in ended)
    assert any(x.startswith("[sweep] interrupted #0: balancer.alpha=0.25: its process is gone") for x in ended)
    assert summary(sweep / "1")["status"] == "finished" and steps(sweep / "1", "train") == list(range(1, 13))
    assert [p.status for p in sorted(load_sweep(sweep).points, key=lambda p: p.num)] == ["interrupted", "finished"]
