"""Nothing overwritten silently (issue 26): a run dir holding another config's run is refused, a point whose process
is gone is "interrupted" (sweep.json and the report, so that report --watch ends), a reused point keeps its own
curves and W&B id, and a reused summary is verified. Unit tests on hand-made dirs; the real reruns are in
tests/test_train.py (refused / trainer.overwrite=true) and the identical-sweep rerun there."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from hydra import compose, initialize_config_module

import kdexp.conf  # noqa: F401
from kdexp.config import config_hash
from kdexp.report.live import watch
from kdexp.report.rundirs import load_sweep
from kdexp.track import claim, records, rundir
from kdexp.track.points import rebuild_sweep


def cfg_of(*args: str):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(args))


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "SUBMITIT_EXECUTOR", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)


def test_overwrite_is_not_part_of_the_identity():
    assert config_hash(cfg_of("trainer.overwrite=true")) == config_hash(cfg_of())
    assert config_hash(cfg_of("trainer.max_steps=3")) != config_hash(cfg_of())


def test_a_run_dir_of_another_config_is_refused_unless_asked_to_start_over(tmp_path):
    run = tmp_path / "run"
    claim.claim(run, "aaaa", overwrite=False)  # an empty dir: this run's
    assert rundir.owner(run) == "aaaa"
    claim.claim(run, "aaaa", overwrite=False)  # the same config again: resume / already finished
    for name, text in ((records.METRICS, '{"step": 1}\n'), (records.SUMMARY, '{"config_hash": "aaaa"}'),
                       ("wandb_id", "abc123\n"), ("checkpoints/step_1/tp0.pt", "w")):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    with pytest.raises(rundir.RunDirTaken) as err:
        claim.claim(run, "bbbb", overwrite=False)
    assert str(err.value) == (f"{run} holds the run of another config (aaaa; this config is bbbb): not overwritten; "
                              "use another run dir (hydra.run.dir=...), or trainer.overwrite=true to delete that run "
                              "and start over")
    assert (run / records.METRICS).read_text() == '{"step": 1}\n'  # untouched
    claim.claim(run, "bbbb", overwrite=True)
    assert rundir.owner(run) == "bbbb"
    assert not any((run / n).exists() for n in (records.METRICS, records.SUMMARY, "wandb_id", "checkpoints"))
    # a dir that ran before run.json existed is known by its summary
    old = tmp_path / "old"
    old.mkdir()
    (old / records.SUMMARY).write_text('{"config_hash": "cccc", "status": "finished"}')
    with pytest.raises(rundir.RunDirTaken, match=r"\(cccc; this config is dddd\)"):
        claim.claim(old, "dddd", overwrite=False)


def _finished(run, key="k1", steps=4, wandb="w1"):
    run.mkdir(parents=True, exist_ok=True)
    records.write_json(run / records.RUN, {"config_hash": key})
    records.write_json(run / records.SUMMARY, {"config_hash": key, "status": "finished", "steps": steps,
                                               "final": {"train/loss": 1.0}})
    (run / records.METRICS).write_text("".join(json.dumps({"step": s, "kind": "train", "train/loss": 5.0 - s}) + "\n"
                                               for s in range(1, steps + 1)))
    (run / "wandb_id").write_text(wandb + "\n")
    return run


def test_a_reused_summary_is_verified_not_trusted(tmp_path):
    good = _finished(tmp_path / "good")
    summary, problem = rundir.verified_summary(good, "k1")
    assert problem is None and summary["steps"] == 4
    assert rundir.verified_summary(good, "k2") == (None, "its summary.json is of config k1, not k2")
    torn = _finished(tmp_path / "torn")
    (torn / records.METRICS).write_text((torn / records.METRICS).read_text().splitlines()[0] + "\n")
    assert rundir.verified_summary(torn, "k1")[1] == "its metrics.jsonl ends at step 1, its summary says 4 steps"
    taken = _finished(tmp_path / "taken")
    records.write_json(taken / records.RUN, {"config_hash": "k9"})  # the dir now holds another config's run
    assert rundir.verified_summary(taken, "k1")[1] == "it now holds the run of config k9"
    assert rundir.verified_summary(tmp_path / "none", "k1")[1] == "its summary.json is missing or unreadable"


def test_a_reused_point_keeps_its_curves_and_wandb_id_when_its_source_moves(tmp_path):
    source = _finished(tmp_path / "first" / "0")
    point = tmp_path / "second" / "0"
    rundir.copy_record(source, point)
    assert rundir.wandb_id(point) == "w1"
    records.write_json(point / records.SUMMARY, {**records.read_json(source / records.SUMMARY),
                                                 "reused_from": str(source), "wandb_id": "w1"})
    os.rename(tmp_path / "first", tmp_path / "moved")
    [p] = load_sweep(tmp_path / "second").points
    assert p.status == "finished" and p.reused_from == str(source)
    assert p.curves["train/loss"] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _running_point(sweep, num, **extra):
    run = sweep / str(num)
    run.mkdir(parents=True)
    records.write_json(run / records.POINT, {"num": num, "run_dir": str(run), "status": "running", "overrides": [],
                                             "metrics": {}, "error": None, **extra})
    (run / records.METRICS).write_text(json.dumps({"step": 1, "kind": "train", "train/loss": 3.0}) + "\n")
    return run


def test_liveness_by_pid_on_this_host_and_by_heartbeat_elsewhere(tmp_path):
    sweep = tmp_path / "sweep"
    here = socket.gethostname()
    dead = _running_point(sweep, 0, host=here, pid=_dead_pid())
    alive = _running_point(sweep, 1, host=here, pid=os.getpid())
    remote = _running_point(sweep, 2, host="node-elsewhere", pid=os.getpid())
    records.beat(remote)
    assert records.liveness(records.read_json(dead / records.POINT)) == "interrupted"
    assert records.liveness(records.read_json(alive / records.POINT)) == "running"
    assert records.liveness(records.read_json(remote / records.POINT)) == "running"  # a fresh beat
    old = time.time() - records.STALE_S - 60
    os.utime(remote / records.HEARTBEAT, (old, old))  # no beat for STALE_S: the process on that node is gone
    assert records.liveness(records.read_json(remote / records.POINT)) == "interrupted"
    # a pending point of a sweep whose launcher stopped beating never started: interrupted too
    assert records.liveness({"status": "pending"}, sweep) == "pending"  # no heartbeat at all: no verdict
    records.beat(sweep)
    assert records.liveness({"status": "pending"}, sweep) == "pending"
    os.utime(sweep / records.HEARTBEAT, (old, old))
    assert records.liveness({"status": "pending"}, sweep) == "interrupted"
    hb = records.Heartbeat(sweep, interval=0.05).start()  # the thread keeps it fresh
    try:
        assert records.liveness({"status": "pending"}, sweep) == "pending"
    finally:
        hb.stop()


def test_a_killed_sweep_is_interrupted_in_sweep_json_and_the_report_and_watch_ends(tmp_path):
    sweep = tmp_path / "sweep"
    here = socket.gethostname()
    _running_point(sweep, 0, host=here, pid=_dead_pid())
    records.write_json(sweep / records.SWEEP, {"sweep_dir": str(sweep), "total": 2, "points": [
        {"num": 0, "run_dir": None, "status": "pending", "overrides": [], "metrics": {}, "error": None},
        {"num": 1, "run_dir": None, "status": "pending", "overrides": [], "metrics": {}, "error": None}]})
    records.beat(sweep)
    old = time.time() - records.STALE_S - 60
    os.utime(sweep / records.HEARTBEAT, (old, old))  # the launching process is gone too
    built = rebuild_sweep(sweep)
    assert [p["status"] for p in built["points"]] == ["interrupted", "interrupted"]
    assert built["counts"]["interrupted"] == 2 and built["counts"]["running"] == 0
    assert sorted(p.status for p in load_sweep(sweep).points) == ["interrupted", "interrupted"]
    files = watch(sweep, interval=0.01, max_polls=3, echo=lambda line: None)
    assert files is not None and not files.live  # --watch ends on its first look
    assert "2 points: 2 interrupted" in files.html.read_text()


def test_a_refused_run_removes_only_the_empty_dirs_made_for_it(tmp_path):
    made = tmp_path / "outputs" / "day" / "run"
    claim.note_new_dirs(made)  # before Hydra makes them
    made.mkdir(parents=True)
    claim.refused(made)
    assert not (tmp_path / "outputs").exists()
    mine = tmp_path / "mine"  # a dir that was there before the run: kept, even empty
    mine.mkdir()
    claim.note_new_dirs(mine)
    claim.refused(mine)
    assert mine.is_dir()
    other = tmp_path / "other"  # a parent that was there before the run: kept
    other.mkdir()
    claim.note_new_dirs(other / "x")
    (other / "x").mkdir()
    claim.refused(other / "x")
    assert not (other / "x").exists() and other.is_dir()
    held = tmp_path / "held"
    held.mkdir()
    (held / "summary.json").write_text("{}")
    claim.refused(held)  # a sweep point's dir that holds files stays
    assert (held / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("claimed", [False, True])
def test_sigterm_before_the_claim_removes_the_dirs_made_for_the_run(tmp_path, claimed):
    # torchrun SIGTERMs rank 0 when another rank refused: rank 0 may be between Hydra's mkdir and its own refusal
    made = tmp_path / "outputs" / "day" / "run"
    script = (f"import os, signal\nfrom kdexp.track import claim\nclaim.note_new_dirs({str(made)!r})\n"
              "claim.clean_up_on_sigterm_before_claim()\n"
              f"os.makedirs({str(made)!r})\n"
              + (f"claim.claim({str(made)!r}, 'k', overwrite=False)\n"
                 "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n" if claimed else "")
              + "os.kill(os.getpid(), signal.SIGTERM)\nraise SystemExit('SIGTERM did not end the process')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -15, r.stderr  # ended by the signal, as without the handler
    if claimed:  # the run's own dir: kept (training's own handler takes over once it starts)
        assert made.is_dir() and (made / "run.json").is_file()
    else:
        assert not (tmp_path / "outputs").exists()


def test_under_a_launch_of_several_ranks_the_others_wait_for_rank_0_to_claim_the_run_dir(tmp_path, monkeypatch):
    # when every rank's Hydra made the dir, one rank's refusal removed it and another's Hydra made it again: left behind
    run_dir = tmp_path / "outputs" / "run"

    def rank0_claims():  # rank 0's Hydra makes the dir, its claim takes the lock
        run_dir.mkdir(parents=True)
        (run_dir / claim.LOCK).touch()

    rank0 = threading.Timer(0.5, rank0_claims)
    start = time.monotonic()
    rank0.start()
    claim.wait_for_rank_0(run_dir)
    rank0.join()
    assert time.monotonic() - start >= 0.4 and (run_dir / claim.LOCK).is_file()
    claim.note_new_dirs(run_dir)  # this rank made nothing: its refusal removes nothing (rank 0's does)
    claim.refused(run_dir)
    assert run_dir.is_dir()
    monkeypatch.setattr(claim, "WAIT_FOR_RANK_0_S", 0.2)  # rank 0 never claims (stopped): the wait ends
    start = time.monotonic()
    claim.wait_for_rank_0(tmp_path / "never")
    assert 0.15 <= time.monotonic() - start < 5 and not (tmp_path / "never").exists()
