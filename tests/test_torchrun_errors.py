"""A failed launch under a real 2-process torchrun (gloo, CPU).

kdexp's own launcher (``python -m kdexp.launchers torchrun``, torchrun's arguments): a user error is the workers' one
line and exit 2, as a single process; another failure is torchrun's summary without the launcher's traceback and the
root cause's status. Plain torchrun: its summary names kdexp's line as the root cause (each rank writes it into its
TORCHELASTIC_ERROR_FILE), then torchrun's own traceback and status 1 (docs/running.md says so)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from _launch import command, kdexp_run

pytestmark = pytest.mark.slow

LINE = "kdexp: error: trainer.lr=-1.0 is invalid: must be a finite number > 0"


def _launch(tmp_path, env, launcher: str, args=(), entry=None) -> tuple[int, str]:
    """A 2-rank launch under `launcher` (tests/_launch.py's LAUNCHERS); asserts it wrote nothing: no run dir, nothing
    new in the cache."""
    cache = sorted(Path(env["KDEXP_CACHE"]).rglob("*"))
    r = kdexp_run(args, env, tmp_path, check=False, timeout=300, torchrun=2, launcher=launcher, entry=entry)
    assert not (tmp_path / "run").exists() and sorted(Path(env["KDEXP_CACHE"]).rglob("*")) == cache
    return r.returncode, r.stdout + r.stderr


def test_kdexp_torchrun_ends_a_user_error_as_one_process_does(env, tmp_path):
    rc, out = _launch(tmp_path, env, "kdexp", ["trainer.lr=-1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2, out
    # once, whichever rank refused first (torchrun stops the other: rank 0 may not live to say it)
    assert [x for x in out.splitlines() if x.startswith("kdexp:")] == [LINE]
    assert "Traceback (most recent call last)" not in out and "FAILED" not in out and "exitcode" not in out, out


def test_kdexp_torchrun_reports_another_failure_without_its_traceback(env, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    rc, out = _launch(tmp_path, env, "kdexp", entry=str(script))
    assert rc == 3, out
    root = out.split("Root Cause")[-1]
    assert re.search(r"rank\s*:\s*1 ", root) and re.search(r"exitcode\s*:\s*3 ", root), out
    assert "Traceback (most recent call last)" not in out and "ChildFailedError" not in out, out


def test_plain_torchrun_names_kdexps_line_as_the_root_cause(env, tmp_path):
    rc, out = _launch(tmp_path, env, "torchrun", ["trainer.lr=-1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 1  # torchrun's own status for any failed worker (documented)
    root = out.split("Root Cause")[-1]
    assert re.search(r"exitcode\s*:\s*2 ", root) and f"traceback : {LINE}" in root, out
    assert "kdexp/" not in out.split("ChildFailedError")[0]  # no Python traceback of kdexp's


def test_kdexp_torchrun_stopped_by_sigterm_forwards_it_and_ends_in_one_line(env, tmp_path):
    import signal
    import time

    script = tmp_path / "waits.py"  # each worker says it started, then waits for the signal torchrun forwards
    script.write_text("import os, pathlib, time\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'up' + os.environ['RANK']).touch()\n"
                      "time.sleep(600)\n")
    proc = subprocess.Popen(command([], torchrun=2, launcher="kdexp", entry=str(script)), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not ((tmp_path / "up0").exists() and (tmp_path / "up1").exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert [x for x in out.splitlines() if x.startswith("kdexp:")] == [
        "kdexp: torchrun stopped by SIGTERM; its workers were sent SIGTERM"], out
    assert "Traceback (most recent call last)" not in out, out
