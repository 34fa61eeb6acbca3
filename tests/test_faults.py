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
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from kdexp.track import faults
from kdexp.track.metrics import MetricsFile

RUN = ["experiment=smoke", "model.embedded_teacher=shipped", "logger=none"]  # shipped teacher: nothing pretrained


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


def _run(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "kdexp.run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_a_read_only_run_dir_is_one_line_exit_1_before_any_work(env, tmp_path):
    if os.geteuid() == 0:
        cm = tmpfs(tmp_path / "ro", "ro,size=1m")
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        cm = contextmanager(lambda: (yield tmp_path / "ro"))()
    with cm as ro:
        proc = _run([*RUN, f"hydra.run.dir={ro / 'run'}"], env, tmp_path)
        assert proc.returncode == 1, proc.stderr
        cause = "Read-only file system (EROFS)" if os.geteuid() == 0 else "Permission denied (EACCES)"
        assert proc.stderr.strip() == f"kdexp: error: cannot write {ro / 'run'}: {cause}"
        assert not list(ro.iterdir())


@pytest.mark.slow
def test_a_full_disk_is_one_line_exit_1_and_leaves_no_partial_file(env, tmp_path):
    with tmpfs(tmp_path / "full", "size=300k") as full:
        run_dir = full / "run"
        proc = _run([*RUN, "trainer.checkpoint_interval=1", f"hydra.run.dir={run_dir}"], env, tmp_path)
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
