"""A full disk and a read-only run directory (kdexp.track.faults): one line naming the path and the cause, exit 1, no
partial file. End to end on real filesystems (a read-only and a 300 KiB tmpfs, mounted here when this process may
mount: root with CAP_SYS_ADMIN; otherwise a chmod-ed directory stands for read-only and the full disk is skipped), and
the seams in this process with the OSError a full disk raises."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest

from kdexp.track import faults
from kdexp.track.metrics import MetricsFile
from _launch import kdexp_popen, kdexp_run

RUN = ["experiment=smoke", "model.embedded_teacher=shipped", "logger=none"]  # shipped teacher: nothing pretrained
TESTS = str(Path(__file__).parent)  # the -c scripts below import the full-disk seam from tests/_disk.py


@contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted at `where` (skips when this process may not mount)."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.slow
def test_a_read_only_run_dir_is_one_line_exit_1_before_any_work(env, tmp_path):
    if os.geteuid() == 0:
        cm = tmpfs(tmp_path / "ro", "ro,size=1m")
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        cm = contextmanager(lambda: (yield tmp_path / "ro"))()
    with cm as ro:
        proc = kdexp_run([*RUN, f"hydra.run.dir={ro / 'run'}"], env, tmp_path, check=False)
        assert proc.returncode == 1, proc.stderr
        cause = "Read-only file system (EROFS)" if os.geteuid() == 0 else "Permission denied (EACCES)"
        assert proc.stderr.strip() == f"kdexp: error: cannot write {ro / 'run'}: {cause}"
        assert not list(ro.iterdir())


@pytest.mark.slow
def test_a_full_disk_is_one_line_exit_1_and_leaves_no_partial_file(env, tmp_path):
    with tmpfs(tmp_path / "full", "size=300k") as full:
        run_dir = full / "run"
        proc = kdexp_run([*RUN, "trainer.checkpoint_interval=1", f"hydra.run.dir={run_dir}"], env, tmp_path,
                         check=False)
        assert proc.returncode == 1, proc.stderr[-3000:]
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("kdexp:")]
        assert line.startswith(f"kdexp: error: cannot write {run_dir}") and \
            line.endswith(": No space left on device (ENOSPC)"), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr
        files = [p for p in run_dir.rglob("*") if p.is_file()]
        assert not [p for p in files if p.name.endswith(".tmp") or ".tmp-" in p.name]
        assert not (run_dir / "summary.json").exists()
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            json.loads(line)  # no half line
        for step in (run_dir / "checkpoints").glob("step_*"):  # every step dir left is a committed checkpoint
            assert list(step.glob("tp*.json")), list(step.iterdir())


# In a sweep: training replaced by what a full disk does to the first checkpoint of point 0 (torch.save's RuntimeError
# whose context is the OSError, named by faults.writing as kdexp.train.loop does); point 1 finishes.
_FULL_DISK_IN_A_SWEEP = textwrap.dedent(f"""
    import sys; sys.path.insert(0, {TESTS!r})
    import kdexp.run, kdexp.train.loop
    from _disk import raise_full_disk
    from kdexp.track import faults
    def distill(cfg, run_dir, **kwargs):
        if cfg.trainer.seed == 1:
            with faults.writing(f"{{run_dir}}/checkpoints/step_3"):
                raise_full_disk()
        return {{"train/loss": 1.0}}, None
    kdexp.train.loop.distill = distill
    kdexp.run.cli()
""")


def test_a_disk_fault_in_a_sweep_point_is_its_one_line_in_its_record_and_the_sweeps_output(env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = kdexp_run([*RUN, "-m", "trainer.seed=1,2", f"hydra.sweep.dir={sweep_dir}"], env, tmp_path, check=False,
                     timeout=600, code=_FULL_DISK_IN_A_SWEEP)
    assert proc.returncode == 1, proc.stderr[-3000:]
    from kdexp.track import records

    sweep = records.read_json(sweep_dir / records.SWEEP)
    failed, done = sweep["points"]
    line = f"cannot write {failed['run_dir']}/checkpoints/step_3: No space left on device (ENOSPC)"
    assert (failed["status"], failed["error"]) == ("failed", line)
    assert records.read_json(Path(failed["run_dir"]) / records.POINT)["error"] == line
    assert line in (Path(failed["run_dir"]) / records.ERROR_LOG).read_text()
    assert done["status"] == "finished"
    assert f"kdexp: error: {line}" in proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
    assert any(x.startswith("[sweep] failed #0: ") and f": {line} (see " in x for x in proc.stdout.splitlines()), \
        proc.stdout


# kdexp.run where global rank 0's checkpoint file meets a full disk (torch.save's RuntimeError from ENOSPC).
_RANK0_FULL_DISK = textwrap.dedent(f"""
    import os, sys; sys.path.insert(0, {TESTS!r})
    if os.environ.get("RANK") == "0":
        import kdexp.train.checkpoint as ck
        from _disk import raise_full_disk
        ck.atomic_torch_save = raise_full_disk
    import kdexp.run
    kdexp.run.cli()
""")


@pytest.mark.slow
def test_a_checkpoint_write_that_fails_on_rank_0_of_two_ends_both_ranks_with_its_line(env, tmp_path):
    """TP=2, two processes started as a bare srun would (torchrun's variables, no torchrun to stop the other rank):
    both exit 1 within the timeout (a rank left waiting fails the test), rank 0 prints the one line, rank 1 no
    traceback (before: "Connection closed by peer" from the barrier over gloo, a wait until the time limit where
    the failed rank stays up), and the step that failed leaves no files."""
    from kdexp.distributed.testing import free_port

    run_dir = tmp_path / "run"
    port = str(free_port())
    procs = [kdexp_popen([*RUN, "parallel.tensor=2", f"hydra.run.dir={run_dir}"],
                         {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}, tmp_path, code=_RANK0_FULL_DISK,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1], [e[-3000:] for _, e in outs]
    line = f"kdexp: error: cannot write {run_dir}/checkpoints/step_3: No space left on device (ENOSPC)"
    assert [x for x in outs[0][1].splitlines() if x.startswith("kdexp:")] == [line]
    assert "Traceback" not in outs[0][1] and "Traceback" not in outs[1][1], outs[1][1][-3000:]
    assert not (run_dir / "checkpoints" / "step_3").exists()


# --- the seams, in this process ------------------------------------------------------------------------------------
def test_a_disk_fault_is_found_in_the_chain_and_named_with_its_path():
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("unexpected pos 10560 vs 10454")  # what torch.save turns ENOSPC into
    except RuntimeError as exc:
        err = exc
    with pytest.raises(RuntimeError), faults.writing("/runs/a/checkpoints/step_3"):
        raise err
    fault = faults.disk_fault(err)
    assert faults.describe(fault) == "cannot write /runs/a/checkpoints/step_3: No space left on device (ENOSPC)"
    assert faults.disk_fault(RuntimeError("not a disk")) is None
    assert faults.disk_fault(OSError(errno.ENOENT, "gone")) is None


def test_a_metrics_line_that_does_not_fit_is_cut_back(tmp_path, monkeypatch):
    m = MetricsFile(tmp_path / "metrics.jsonl", enabled=True)
    m.write({"step": 1, "kind": "train", "train/loss": 1.0})
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of the line
        real_write(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as err:
        m.write({"step": 2, "kind": "train", "train/loss": 0.5})
    monkeypatch.undo()
    assert err.value.filename == str(tmp_path / "metrics.jsonl")
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_log_file_on_a_full_disk_stops_at_the_next_step_without_a_traceback_per_record(tmp_path, capsys):
    logger = logging.getLogger("kdexp.test_faults")
    handler = logging.FileHandler(tmp_path / "run.log")

    def emit(record):  # what FileHandler.emit does when the disk is full
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            handler.handleError(record)

    handler.emit = emit
    logger.addHandler(handler)
    try:
        faults.watch_log_files()
        logger.error("one")
        logger.error("two")  # the handler is gone: no second fault, no traceback
        assert "Logging error" not in capsys.readouterr().err
        with pytest.raises(OSError) as err:
            faults.raise_pending()
        assert faults.describe(err.value) == f"cannot write {tmp_path / 'run.log'}: No space left on device (ENOSPC)"
        faults.raise_pending()  # raised once
        assert handler not in logger.handlers
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_probe_names_a_directory_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):  # not a disk fault (ENOTDIR): a real error, not hidden
        faults.probe(tmp_path / "file" / "run")
    assert faults.probe(tmp_path / "ok" / "run") is None and not list((tmp_path / "ok" / "run").iterdir())


def test_a_point_whose_records_the_full_disk_refuses_still_returns_its_line(tmp_path, monkeypatch):
    """record_failure on a disk that takes neither error.log nor point.json: the entry it returns (which the sweep
    prints and hands to Hydra) still carries the one line, and nothing half-written is left."""
    from kdexp.track import points, records

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "point.json"))

    monkeypatch.setattr(records, "write_json", full)
    monkeypatch.setattr(records, "write_error", full)
    fault = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "checkpoints"))
    point = points.record_failure(tmp_path, fault)
    assert point["status"] == "failed"
    assert point["error"] == f"cannot write {tmp_path / 'checkpoints'}: Read-only file system (EROFS)"
    assert not list(tmp_path.iterdir())
