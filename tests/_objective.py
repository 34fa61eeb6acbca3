"""The trainer's objective (kdexp.objective) on given logits, for tests: built through the registry as setup
builds it, on the reference (unfused) path; kd and stats are masked means over the batch's own tokens."""
from __future__ import annotations

import torch

from kdexp import objective


def kd_loss(student: torch.Tensor, teacher, mask: torch.Tensor, loss_cfg, *, sample_index=None, seed: int = 0):
    """(kd, stats) of the objective on `student` logits [b, s, V] from `teacher` logits [b, s, V], or from a
    kdexp.teacher.TeacherCache at `sample_index`."""
    cached = sample_index is not None
    source = objective.CachedTeacher(teacher) if cached else None
    loss = objective.LossOptions.parse(loss_cfg)
    term = objective.LOSSES[(objective.family(loss), "cached" if cached else "online")](loss, source)
    obj = objective.Objective(loss_cfg, source, term, fused=False, fuses_lm=False)
    t_out = objective.ModelOut(sample_index=sample_index) if cached else objective.ModelOut(logits=teacher)
    batch = {"labels": torch.zeros(mask.shape, dtype=torch.long), "loss_mask": mask}
    r = obj(objective.ModelOut(logits=student), t_out, batch, mask.sum().clamp(min=1.0), seed=seed, needs_lm=False)
    return r.kd, r.stats
