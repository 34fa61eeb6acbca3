"""Test-only entry point: `python tests/_nan_run.py STEPS [hydra args ...]` runs kdexp.run with the backward pass of
the given training steps (comma-separated, 1-based as logged) poisoned: one gradient entry becomes NaN and the loss
+inf, as when a step overflows. The other steps are untouched, so a skipped bad step leaves the run intact.

The loop asks ``optim.lr_at(step)`` right before each step, which tells this wrapper the step it is in (also on a
resumed run); the teacher's pretraining calls lr_at too but never the step driver's train_step.
"""
import sys

from kdexp.train import optim
from kdexp.train import step as step_module

bad_steps = {int(s) for s in sys.argv.pop(1).split(",") if s}
_current = {"step": 0}
_lr_at, _train_step = optim.lr_at, step_module.train_step


def lr_at(step, **kwargs):
    _current["step"] = step + 1
    return _lr_at(step, **kwargs)


def train_step(student, *args, **kwargs):
    parts = _train_step(student, *args, **kwargs)
    if _current["step"] in bad_steps:
        grad = next(p.grad for p in student.parameters() if p.grad is not None)
        grad.view(-1)[0] = float("nan")
        parts["train/loss"] = parts["train/loss"] + float("inf")
    return parts


optim.lr_at, step_module.train_step = lr_at, train_step

from kdexp.run import cli  # noqa: E402  (after the patches: the run starts when cli() is called)

cli()
