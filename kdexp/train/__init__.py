"""Training: the distillation loop, the frozen teacher, evaluation, checkpoint/resume, one run from start to summary."""
from kdexp.train.errors import Diverged
from kdexp.train.point import run_point

__all__ = ["Diverged", "run_point"]
