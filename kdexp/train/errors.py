"""Errors a training run ends with on purpose (stdlib only, so run.py and the sweep can import them cheaply)."""
from __future__ import annotations

from typing import Optional


class Diverged(RuntimeError):
    """A non-finite loss, gradient norm, eval metric or weight stopped the run (exit status != 0).

    ``step``: the step that went non-finite (1-based, as logged); ``metrics``: the last finite train/eval metrics;
    ``skipped``: non-finite steps skipped before (``trainer.skip_nonfinite``); ``checkpoint``: the step of the last
    finite checkpoint kept on disk (None when there is none).
    """

    def __init__(self, message: str, *, step: int, metrics: Optional[dict] = None, skipped: int = 0,
                 checkpoint: Optional[int] = None) -> None:
        super().__init__(message)
        self.step = step
        self.metrics = dict(metrics or {})
        self.skipped = skipped
        self.checkpoint = checkpoint
