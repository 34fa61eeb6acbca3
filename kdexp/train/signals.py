"""Preemption: a signal asks the trainer to checkpoint at the next step boundary, say so in one line and end the run.

The signals: SIGTERM (what SLURM sends on preemption, at the time limit and on ``scancel``; what torchrun forwards),
SIGUSR1, and submitit's preemption signal (SIGUSR2, or ``SUBMITIT_PREEMPT_SIGNAL``): the launcher presets ask SLURM
for it ``signal_delay_s`` seconds before the time limit (``--signal=USR2@<delay>``).

How a kdexp job meets submitit: the SLURM task runs ``submitit.core._submit``, which installs its own handlers (USR2:
call the submitted callable's ``checkpoint()`` (hydra-submitit-launcher's resubmits the same Hydra job), ``scontrol
requeue`` the job, exit; SIGTERM: log "bypassing" and carry on), then runs Hydra's ``run_job`` -> kdexp.run -> the
loop. Left alone, USR2 would requeue in the middle of a step with nothing saved since the last periodic checkpoint.
So while the loop runs, `Preemption` holds these signals: the handler only records the signal (a handler runs
between two bytecodes of the main thread; saving there could tear a step), and at each step boundary every rank
agrees on it (a MAX all-reduce of one int: SLURM signals every task, but a signal that reached one rank must stop all
of them at the same step). Then the loop saves the current step (unless that step was just saved), logs one line,
and `stop()` hands over to whichever handler the signal had before (submitit's: it requeues the job and exits on
rank 0; it returns on the other ranks), waits at a barrier so that no rank ends before the requeue was asked for,
and ends the process with `Preempted`.

`Preempted` is a SystemExit: it passes every ``except Exception`` on the way out (no error.log, no "failed" point:
the run did not fail, and a Hydra sweep in one process stops as a whole instead of going on to its next point). Its
exit status is 128 + the signal number (143 for SIGTERM), the status a shell reports for a process that signal
ended, so wrappers that already treat "ended by SIGTERM" as "retry" keep working; it differs from 0 (finished), 1
(failed) and 2 (user error). The rerun (the same command in the same run dir; a SLURM requeue does exactly that)
resumes from the saved step: no step is redone and the result is bit-identical to an uninterrupted run.

Before the loop (data, teacher pretraining, cache build) the previous handlers stay in place: submitit requeues at
once and a lone process dies of SIGTERM; everything built there is cached and resumes on the rerun.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from kdexp import distributed

log = logging.getLogger("kdexp")


def preempt_signals() -> list[int]:
    """SIGTERM, SIGUSR1 and submitit's preemption signal (SUBMITIT_PREEMPT_SIGNAL, default USR2)."""
    sigs = [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2]
    extra = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    if isinstance(extra, signal.Signals) and extra not in sigs:
        sigs.append(extra)
    return sigs


class Preempted(SystemExit):
    """The run saved step `step` after `signum` asked it to stop; exit status 128 + signum."""

    def __init__(self, signum: int, step: int, message: str):
        super().__init__(128 + signum)
        self.signum, self.step, self.message = signum, step, message

    def __str__(self) -> str:
        return self.message


class Preemption:
    """Records the preemption signals while the loop runs (a context manager); `agreed()` at each step boundary."""

    def __init__(self, signals: Optional[list[int]] = None):
        self.signals = preempt_signals() if signals is None else signals
        self.signum = 0  # the first signal received (0: none)
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame) -> None:
        if not self.signum:
            self.signum = signum

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def agreed(self, device) -> int:
        """The signal to stop for, the same on every rank (collective when there is a process group), or 0."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def stop(self, signum: int, step: int, message: str) -> None:
        """End the process after the checkpoint: the signal's previous handler first (submitit's requeues the job),
        a barrier so that no rank ends before it did, then `Preempted` (or what that handler raised)."""
        previous = self._previous.get(signum)
        raised: Optional[BaseException] = None
        if callable(previous) and previous is not signal.default_int_handler:
            try:
                previous(signum, None)
            except BaseException as exc:  # noqa: BLE001 - submitit ends rank 0 with SystemExit after the requeue
                raised = exc
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        distributed.ended_cleanly()  # every rank stops here, after the barrier: the group can go at exit
        if raised is not None:
            raise raised
        raise Preempted(signum, step, message)


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def resume_hint(run_dir: Path, signum: Optional[int] = None) -> str:
    """How this run continues after signal ``signum``: submitit requeues the job only for its own requeue signal
    (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise; its SIGTERM handler only logs, on SLURM and under the
    local executor alike); otherwise a sweep resumes the point when rerun, and a single run is rerun with its
    overrides in the same run dir (the default run dir is a new timestamp, hence hydra.run.dir)."""
    from kdexp.distributed.launch import launch_env

    source = launch_env().source
    nothing = ""
    if source == "submitit":
        requeue = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
        if signum is None or signum == requeue:
            return "submitit requeues the job, which resumes from this step"
        nothing = (f"nothing requeues the job (submitit requeues on {name(requeue) if requeue else '?'} only, not "
                   f"{name(signum)}); ")
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except Exception:  # noqa: BLE001 - not a Hydra job (a tool calling the loop)
        return f"{nothing}rerun in {run_dir} to resume from this step"
    if hc.mode == RunMode.MULTIRUN:
        return f"{nothing}rerun the same sweep command: it resumes this point from this step"
    overrides = [o for o in hc.overrides.task]
    args = " ".join(shlex.quote(a) for a in [*overrides, f"hydra.run.dir={Path(run_dir).resolve()}"])
    launcher = "python -m kdexp.run" if source == "local" else f"the same launcher ({source}) with -m kdexp.run"
    return f"{nothing}resume with: {launcher} {args}"

