"""Hidden-state (intermediate-layer) distillation losses and their rescaling to the logit loss.

ModelOpt's Megatron plugin (NVIDIA/TensorRT-Model-Optimizer, modelopt/torch/distill/plugins/megatron.py:
HiddenStateCosineLoss, MSELoss, ProjectionLayer, LogitsAndIntermediatesLossBalancer) is the behaviour followed:
per-token cosine loss 1 - cos(s, t) and MSE averaged over the hidden dimension, a learnable linear projection of the
student's hidden state when the hidden sizes differ, and the (mean) intermediate loss rescaled to the logit loss's
magnitude with a detached factor, so it steers the direction of the update but not its size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kdexp.losses.options import INTERMEDIATE_KINDS


def _check_pair(student: torch.Tensor, teacher: torch.Tensor):
    if student.shape != teacher.shape:
        raise ValueError(
            f"student hidden states {tuple(student.shape)} and teacher hidden states {tuple(teacher.shape)} differ; "
            "use IntermediateLoss(student_hidden=..., teacher_hidden=...) for a projection"
        )


def cosine_hidden_loss(student: torch.Tensor, teacher: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Per-token 1 - cosine similarity over the last dimension, float32; no gradient to the teacher."""
    _check_pair(student, teacher)
    return 1.0 - F.cosine_similarity(student.float(), teacher.detach().float(), dim=-1, eps=eps)


def mse_hidden_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-token mean squared error over the last dimension, float32; no gradient to the teacher."""
    _check_pair(student, teacher)
    return (student.float() - teacher.detach().float()).pow(2).mean(-1)


class IntermediateLoss(nn.Module):
    """Hidden-state loss between one student layer and one teacher layer.

    kind: "cosine" or "mse". When student_hidden != teacher_hidden a learnable nn.Linear(student_hidden,
    teacher_hidden) projects the student first (its parameters belong to the student's optimizer).
    """

    def __init__(self, kind: str = "cosine", student_hidden: int | None = None, teacher_hidden: int | None = None):
        super().__init__()
        if kind not in INTERMEDIATE_KINDS:
            raise ValueError(f"kind must be one of {INTERMEDIATE_KINDS}, got {kind!r}")
        for name, v in (("student_hidden", student_hidden), ("teacher_hidden", teacher_hidden)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        self.kind = kind
        if student_hidden is not None and teacher_hidden is not None and student_hidden != teacher_hidden:
            self.projection: nn.Module = nn.Linear(student_hidden, teacher_hidden)
        else:
            self.projection = nn.Identity()

    def forward(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        student = self.projection(student)
        fn = cosine_hidden_loss if self.kind == "cosine" else mse_hidden_loss
        return fn(student, teacher)


def mean_of(losses: torch.Tensor | Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    """A scalar, or the mean of several scalar losses (ModelOpt: sum / max(len, 1)); None stays None."""
    if losses is None or isinstance(losses, torch.Tensor):
        return losses
    losses = list(losses)
    if not losses:
        return None
    return torch.stack([x.float() for x in losses]).sum() / len(losses)


def scale_to_logits_loss(intermediate: torch.Tensor, logits_loss: torch.Tensor) -> torch.Tensor:
    """intermediate * (|logits_loss| / |intermediate|).detach(); exactly 0 where intermediate == 0.

    No host sync (torch.where, never `if tensor`): safe inside a CUDA-graph-friendly training step. The safe
    denominator keeps the unselected branch finite, so no NaN reaches the gradient.
    """
    den = intermediate.detach().abs()
    nonzero = den > 0
    ratio = logits_loss.detach().abs() / torch.where(nonzero, den, torch.ones_like(den))
    return torch.where(nonzero, intermediate * ratio, torch.zeros_like(intermediate))
