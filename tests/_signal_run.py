"""Test-only entry point: `python tests/_signal_run.py STEP SIGNAL [hydra args ...]` runs kdexp.run and, in the
middle of step STEP (after its batch is drawn, before its forward), sends SIGNAL (e.g. TERM, USR2) to its own process
with os.kill: a real signal delivered while a step runs, like a scheduler's preemption notice."""
import os
import signal
import sys

from kdexp.train.step import StepDriver

at_step, signum = int(sys.argv.pop(1)), getattr(signal, "SIG" + sys.argv.pop(1))
_driver_step = StepDriver.step


def _signalling_step(self, step, *args, **kwargs):
    if step + 1 == at_step:  # `step` is 0-based, logged steps 1-based
        os.kill(os.getpid(), signum)
    return _driver_step(self, step, *args, **kwargs)


StepDriver.step = _signalling_step

from kdexp.run import cli  # noqa: E402  (after the patch: the run starts when cli() is called)

cli()
