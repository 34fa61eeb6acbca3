"""The one way the tests launch a run: ``python -m kdexp.run ARGS`` as users type it (or under
torchrun, or through a test-only entry point that wraps kdexp.run's cli and misbehaves on purpose), and the readers
of what a run leaves in its directory.

    proc = kdexp_run(["experiment=smoke", f"hydra.run.dir={d}"], env, tmp_path)             # raises unless rc 0
    proc = kdexp_run(args, env, tmp_path, check=False, kill_at=5)                         # SIGKILLed after step 5
    proc = kdexp_run(args, env, tmp_path, torchrun=2)                                     # 2 gloo ranks
    proc = kdexp_run(args, env, tmp_path, check=False, entry=NAN_RUN, entry_args=["3"])   # NaN in step 3's backward

``env`` is the whole environment of the child (the conftest ``env`` fixture, usually); None inherits this process's.

A launch run to its end (kdexp_run) of ``python -m MOD``, ``python -c CODE`` or ``python FILE.py`` is forked from this
process's fork server (tests/_zygote.py: torch, megatron-core, Hydra and W&B imported once, kdexp afresh in each
child), not started as a new interpreter, and the sweep workers and torchrun ranks it starts hand themselves over to
the same server; ``fresh=True`` starts a new interpreter, as does kdexp_popen (a process the test holds while it
runs; its own sweep workers and ranks hand over).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from _zygote import Zygote
from kdexp.distributed.testing import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FAULT_RUN = str(HERE / "_fault_run.py")  # `_fault_run.py STEP ARGS`: SIGKILLs itself right after STEP
NAN_RUN = str(HERE / "_nan_run.py")  # `_nan_run.py STEPS ARGS`: a NaN in the backward pass of STEPS ("3,5")
SIGNAL_RUN = str(HERE / "_signal_run.py")  # `_signal_run.py STEP SIGNAL ARGS`: signals itself during STEP
UNCHECKED_RUN = str(HERE / "_unchecked_run.py")  # kdexp.run without the driver's whole-sweep check (a job's own)


def run_env(cache, **extra: str) -> dict:
    """The environment of kdexp.run subprocesses: this one's, KDEXP_CACHE=cache, W&B offline, unbuffered output, no
    inherited run stamp (each run draws its own); ``extra`` on top."""
    e = {**os.environ, "KDEXP_CACHE": str(cache), "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **extra}
    e.pop("KDEXP_RUN_STAMP", None)
    return e


LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run"],  # what `torchrun` runs
             "kdexp": ["-m", "kdexp.launchers", "torchrun"]}  # kdexp's torchrun that passes the ranks' status on


def command(args: Sequence[str], *, torchrun: int = 0, launcher: str = "torchrun", kill_at: int = 0,
            entry: Optional[str] = None, entry_args: Sequence[str] = (), code: Optional[str] = None) -> list[str]:
    """The argv of one launch. ``entry``: a module (run with -m, default kdexp.run) or a .py file; ``kill_at``: the
    FAULT_RUN entry with that step; ``code``: ``python -c code ARGS`` (a test's patch, then kdexp.run.cli());
    ``torchrun``: that many local ranks under ``launcher`` (a LAUNCHERS key) on a free port."""
    if kill_at:
        entry, entry_args = FAULT_RUN, [str(kill_at), *entry_args]
    if code is not None:
        target = ["-c", code]
    else:
        entry = entry or "kdexp.run"
        target = [entry] if entry.endswith(".py") else ["-m", entry]
    if torchrun:
        if code is not None:
            raise ValueError("torchrun runs a module or a script, not -c code")
        return [sys.executable, *LAUNCHERS[launcher], "--nproc-per-node", str(torchrun), "--master-addr",
                "127.0.0.1", "--master-port", str(free_port()), *target, *entry_args, *args]
    return [sys.executable, *target, *entry_args, *args]


def kdexp_run(args: Sequence[str], env: Optional[dict] = None, cwd=None, *, check: bool = True,
              extra_env: Optional[dict] = None, timeout: float = 900, fresh: bool = False,
              **how) -> subprocess.CompletedProcess:
    """Run one launch (``how``: command()'s keywords) to its end, output captured, as a child of the fork server
    unless ``fresh`` (a new interpreter). ``check``: a non-zero exit raises with the command and the tails of both
    streams; a launch past ``timeout`` seconds is killed and raises so too, whatever ``check``."""
    cmd = command(args, **how)
    full_env = None if env is None and not extra_env else {**(os.environ if env is None else env),
                                                           **(extra_env or {})}
    try:
        if not fresh and Zygote.accepts(cmd):
            proc = Zygote.run(cmd, os.environ if full_env is None else full_env, cwd, timeout)
        else:
            proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # what it printed (through the server: its threads' stacks at the end)
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        raise AssertionError(f"{cmd} ran past its {timeout} s and was killed:\n{out[-4000:]}\n{err[-8000:]}") from e
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def kdexp_popen(args: Sequence[str], env: Optional[dict] = None, cwd=None, *, entry: Optional[str] = None,
                code: Optional[str] = None, **popen) -> subprocess.Popen:
    """The same launch left running (the caller waits, signals or kills it; its pid is the run's); ``popen`` goes
    to subprocess.Popen. It is a new interpreter, but the workers of a local sweep it runs and the ranks its
    torchrun starts hand themselves over to this process's fork server, as kdexp_run's do."""
    return subprocess.Popen(command(args, entry=entry, code=code), cwd=cwd,
                            env=Zygote.child_env(os.environ if env is None else env), **popen)


def metrics(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics.jsonl lines of one kind (train, val, ...), in order."""
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == kind]


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def comparable(final: dict) -> dict:
    """A summary's final metrics without the timings, which no two runs share."""
    return {k: v for k, v in final.items() if not k.startswith("perf/")}
