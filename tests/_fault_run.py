"""Test-only entry point: `python tests/_fault_run.py STEP [hydra args ...]` runs kdexp.run but SIGKILLs itself right
after step STEP (its eval and checkpoint done), like a preempted node; the resume tests use it."""
import os
import signal
import sys

from kdexp.train import loop

kill_at = int(sys.argv.pop(1))


def _kill(step: int) -> None:
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


loop.add_step_end_hook(_kill)

from kdexp.run import cli  # noqa: E402  (after the hook: the run starts when cli() is called)

cli()
