"""Points of a submitit-local sweep take one of launch.local_parallel slots before they train (kdexp.track.slots):
at most that many run at once, each with cores // slots CPU threads, and a killed point frees its slot."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from _sweep_apps import load_sweep, run_app, write_app
from kdexp.track import slots

# Each job takes a slot, records when it held it and with how many torch threads, and (barrier=true) waits until
# every other job of the sweep holds one too: that can only finish when the slots let them all in at once.
SLOT_TASK = """\
import json
from omegaconf import OmegaConf

from kdexp.track import rundir, slots


def task(cfg):
    sweep_dir = rundir.sweep_dir(HydraConfig.get())
    launch = OmegaConf.create({"local_parallel": cfg.get("par"), "cpu_threads": cfg.get("threads")})
    waits = []
    slot = slots.take_local_slot(launch, sweep_dir, on_wait=waits.append)
    import torch

    start = time.time()
    marks = sweep_dir / "held"
    marks.mkdir(exist_ok=True)
    (marks / str(cfg.x)).touch()
    if cfg.get("barrier"):
        deadline = time.time() + 60
        while len(list(marks.iterdir())) < cfg.n and time.time() < deadline:
            time.sleep(0.05)
        if len(list(marks.iterdir())) < cfg.n:
            raise RuntimeError("the other points never held a slot at the same time")
    else:
        time.sleep(cfg.hold)
    rec = {"x": cfg.x, "slot": slot, "start": start, "end": time.time(), "threads": torch.get_num_threads(),
           "pid": os.getpid(), "waits": waits}
    (Path(HydraConfig.get().runtime.output_dir) / "slot.json").write_text(json.dumps(rec))
    return {"val/score": float(cfg.x)}
"""


def _held(root) -> list[dict]:
    sweep = load_sweep(root)
    assert [p["status"] for p in sweep["points"]] == ["finished"] * len(sweep["points"]), sweep
    return sorted((json.loads((Path(p["run_dir"]) / "slot.json").read_text()) for p in sweep["points"]),
                  key=lambda r: r["start"])


def test_one_slot_runs_the_points_one_after_another(tmp_path):
    script = write_app(tmp_path / "app", SLOT_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1,2,3", "+par=1", "+hold=2.0", "hydra/launcher=local_cpu"], root)
    assert r.returncode == 0, r.stdout + r.stderr
    held = _held(root)
    assert len({h["pid"] for h in held}) == 3  # each point in its own submitit worker process
    assert [h["slot"] for h in held] == [0, 0, 0]
    for a, b in zip(held, held[1:]):
        assert a["end"] <= b["start"], held  # submitit started all three at once; the slot ran them in turn
    assert all(h["threads"] == slots.cpu_cores() for h in held)  # one point at a time gets every core
    # the first point took the free slot; the others were told when they started and stopped waiting
    assert held[0]["waits"] == [] and all(h["waits"] in ([], [True, False]) for h in held[1:])
    assert [True, False] in [h["waits"] for h in held[1:]]
    logs = "".join(p.read_text() for p in (Path(load_sweep(root)["sweep_dir"]) / ".submitit").glob("*/*_log.out"))
    assert "waiting for a local slot" in logs


def test_two_slots_run_two_points_at_once_with_half_the_threads_each(tmp_path):
    script = write_app(tmp_path / "app", SLOT_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1,2", "+par=2", "+barrier=true", "+n=2", "hydra/launcher=local_cpu"], root)
    assert r.returncode == 0, r.stdout + r.stderr
    held = _held(root)
    assert sorted(h["slot"] for h in held) == [0, 1]
    assert held[0]["end"] > held[1]["start"]  # both held a slot at the same time (the barrier needs it)
    assert all(h["threads"] == max(1, slots.cpu_cores() // 2) for h in held)


def test_cpu_threads_overrides_the_share(tmp_path):
    script = write_app(tmp_path / "app", SLOT_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1", "+par=1", "+hold=0", "+threads=1", "hydra/launcher=local_cpu"], root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [h["threads"] for h in _held(root)] == [1]


def test_basic_launcher_points_are_not_capped(tmp_path):
    # The basic launcher runs points one after another in one process: no slot (and no wait), the threads untouched.
    script = write_app(tmp_path / "app", SLOT_TASK)
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1,2", "+par=1", "+hold=0"], root)
    assert r.returncode == 0, r.stdout + r.stderr
    held = _held(root)
    assert [h["slot"] for h in held] == [None, None]
    assert not (Path(load_sweep(root)["sweep_dir"]) / slots.SLOTS_DIR).exists()


_HOLDER = """\
import sys, time
from kdexp.track import slots
slot, waited = slots.acquire(sys.argv[1], int(sys.argv[2]), poll_s=0.05)
print(f"slot {slot} waited {waited:.2f}", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _holder(sweep_dir, parallel, hold):
    return subprocess.Popen([sys.executable, "-c", _HOLDER, str(sweep_dir), str(parallel), str(hold)],
                            stdout=subprocess.PIPE, text=True)


def test_a_killed_point_frees_its_slot(tmp_path):
    first = _holder(tmp_path, 1, 600)
    assert first.stdout.readline().startswith("slot 0 waited")
    second = _holder(tmp_path, 1, 0)
    time.sleep(1.0)
    assert second.poll() is None  # waits while the only slot is held
    os.kill(first.pid, signal.SIGKILL)  # no cleanup runs: the kernel drops the flock with the process
    first.wait(timeout=30)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0 and out.startswith("slot 0 waited"), out
    assert float(out.split()[-1]) >= 0.9


def test_in_one_process_a_slot_is_taken_once(tmp_path):
    # Re-entrant: a process that holds a slot gets it back at once. A child process (not holding one) must wait.
    slots._HELD.clear()
    try:
        assert slots.acquire(tmp_path, 1)[0] == 0
        assert slots.acquire(tmp_path, 1) == (0, 0.0)
        child = _holder(tmp_path, 1, 0)
        time.sleep(1.0)
        assert child.poll() is None
    finally:
        for fd, _ in slots._HELD:
            os.close(fd)
        slots._HELD.clear()
    out, _ = child.communicate(timeout=60)
    assert out.startswith("slot 0"), out


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_invalid_parallel_is_an_error(tmp_path, bad):
    with pytest.raises(ValueError, match="launch.local_parallel"):
        slots.acquire(tmp_path, bad)


def test_not_under_the_local_executor_nothing_is_taken(tmp_path, monkeypatch):
    monkeypatch.delenv("SUBMITIT_LOCAL_JOB_ID", raising=False)
    launch = OmegaConf.create({"local_parallel": 1, "cpu_threads": None})
    assert slots.take_local_slot(launch, tmp_path) is None
    assert not (tmp_path / slots.SLOTS_DIR).exists()
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "123")
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "2")  # a multi-task local job (torchrun-like): not capped
    assert not slots.under_local_executor()
    assert slots.take_local_slot(launch, tmp_path) is None


def test_default_stamped_sweep_dir_is_one_dir_for_every_local_point(tmp_path):
    # kdexp's own default, hydra.sweep.dir: multirun/${kdexp_stamp:} (date, time to the second, id). Each submitit
    # worker resolves it in its own process, seconds after the submitting one (one at a time here: 1 slot): all must
    # land in the submitting process's dir, and so share its slots.
    script = write_app(tmp_path / "app", SLOT_TASK)
    config = script.parent / "config.yaml"
    config.write_text(config.read_text().replace("${oc.env:SWEEP_ROOT}/${now:%Y-%m-%d}/${kdexp_uid:}",
                                                 "${oc.env:SWEEP_ROOT}/${kdexp_stamp:}"))
    assert "kdexp_stamp" in config.read_text()
    root = tmp_path / "sweeps"
    r = run_app(script, ["x=1,2,3", "+par=1", "+hold=1.1", "hydra/launcher=local_cpu"], root)
    assert r.returncode == 0, r.stdout + r.stderr
    held = _held(root)  # exactly one sweep.json under root, holding all three points
    assert len(held) == 3 and held[-1]["start"] - held[0]["start"] > 2  # the last resolved its dir seconds later
    assert [h["slot"] for h in held] == [0, 0, 0]
    for a, b in zip(held, held[1:]):
        assert a["end"] <= b["start"]
