"""Test-only entry point: `python tests/_signal_run.py STEP SIGNAL [hydra args ...]` runs kdexp.run and, in the
middle of step STEP (after its batch is drawn, before its forward), sends SIGNAL (e.g. TERM, USR2) to its own process
with os.kill: a real signal delivered while a step runs, like a scheduler's preemption notice."""
import os
import signal
import sys

from kdexp.train import loop

at_step, signum = int(sys.argv.pop(1)), getattr(signal, "SIG" + sys.argv.pop(1))
_train_step = loop.train_step


def _signalling_step(*args, step, **kwargs):
    if step + 1 == at_step:  # `step` is 0-based, logged steps 1-based
        os.kill(os.getpid(), signum)
    return _train_step(*args, step=step, **kwargs)


loop.train_step = _signalling_step

from kdexp.run import cli  # noqa: E402  (after the patch: the run starts when cli() is called)

cli()
