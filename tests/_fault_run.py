"""Test-only entry point: `python tests/_fault_run.py STEP [hydra args ...]` runs kdexp.run but SIGKILLs itself right
after step STEP (its eval and checkpoint done: when the trainer asks its step driver for step STEP + 1), like a
preempted node; the resume tests use it."""
import os
import signal
import sys

from kdexp.train.step import StepDriver

kill_at = int(sys.argv.pop(1))
_step = StepDriver.step


def step(self, step: int, *args, **kwargs):
    if step == kill_at:  # 0-based: step STEP + 1 (1-based, as logged) is about to start
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(self, step, *args, **kwargs)


StepDriver.step = step

from kdexp.run import cli  # noqa: E402  (after the patch: the run starts when cli() is called)

cli()
