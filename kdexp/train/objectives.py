"""Per-batch objectives on vocab-parallel logits: LM cross-entropy, the KD loss, the balancer, and eval metrics.

The loss and the balancer are built from their config nodes here, each through its one factory in kdexp.losses
(`KDLossOptions.from_config(...).kwargs()`, `BalancerOptions.from_config(...).build()`).

Every function takes this rank's vocabulary shard ([b, s, V/tp]) and returns values that are equal on every TP rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from kdexp import distributed
from kdexp.losses import BalancerOptions, KDLossOptions, logits_kd_loss
from kdexp.losses import cached_kd_loss as cached_kd_loss_fn


def batch_to(batch: dict, device) -> dict:
    """The fields the objectives read, on the device (position ids are rebuilt by the model code, not copied);
    sample_index (the key into an offline teacher cache) stays on the host."""
    out = {k: batch[k].to(device, non_blocking=True) for k in ("tokens", "labels", "loss_mask")}
    if "sample_index" in batch:
        out["sample_index"] = batch["sample_index"]
    return out


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values.float() * mask).sum() / mask.sum().clamp(min=1.0)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel next-token cross-entropy (Megatron's), masked mean over tokens."""
    x = logits.float()
    if x is logits:  # megatron's cross-entropy works in place; keep the caller's logits intact for the KD loss
        x = logits.clone()
    return masked_mean(tensor_parallel.vocab_parallel_cross_entropy(x, labels), loss_mask)


def build_balancer(balancer_cfg):
    """The balancer a config's `balancer` node describes (its value rules checked first)."""
    return BalancerOptions.from_config(balancer_cfg).build()


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, loss_mask: torch.Tensor, loss_cfg):
    """Masked-mean KD loss and its masked-mean stats, logged as train/kept_mass (the teacher's mass in the kept set),
    train/ghost_mass (the student's mass outside it: its ghost bucket) and train/nucleus_size."""
    per_token, stats = logits_kd_loss(student, teacher, tp_group=distributed.tp_group(), return_stats=True,
                                      **KDLossOptions.from_config(loss_cfg).kwargs())
    return _masked_parts(per_token, stats, loss_mask)


def _masked_parts(per_token, stats, loss_mask):
    loss = masked_mean(per_token, loss_mask)
    return loss, {
        "kept_mass": masked_mean(stats.teacher_kept_mass, loss_mask),
        "ghost_mass": masked_mean(stats.student_residual_mass, loss_mask),
        "nucleus_size": masked_mean(stats.nucleus_size.float(), loss_mask),
    }


def cached_kd_loss(student: torch.Tensor, cache, sample_index, loss_mask: torch.Tensor, loss_cfg):
    """`kd_loss` with the teacher read from an offline cache (kdexp.teacher.TeacherCache) at the loss's temperature:
    the same loss, gradient and stats (kdexp.losses.cached_kd_loss)."""
    opts = KDLossOptions.from_config(loss_cfg)
    values, indices, lse, lse_rest = cache.read(sample_index, opts.temperature, device=student.device)
    per_token, stats = cached_kd_loss_fn(student, values, indices, lse, lse_rest, tp_group=distributed.tp_group(),
                                         return_stats=True, **opts.kwargs())
    return _masked_parts(per_token, stats, loss_mask)


def full_kl(student: torch.Tensor, teacher: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary forward KL(teacher || student) at T=1: the eval metric val/kl_to_teacher."""
    per_token = logits_kd_loss(student, teacher, top_k=None, top_p=None, ghost_token=False,
                               tp_group=distributed.tp_group())
    return masked_mean(per_token, loss_mask)


def vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Global argmax over a vocab-sharded last dim (ties -> the smallest index, like torch.argmax)."""
    st = distributed.state()
    values, idx = logits.float().max(dim=-1)
    if st.tp_size == 1:
        return idx
    idx = idx + st.tp_rank * logits.shape[-1]
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=distributed.tp_group())
    candidate = torch.where(values == best, idx, torch.full_like(idx, torch.iinfo(idx.dtype).max))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=distributed.tp_group())
    return candidate


def top1_agreement(student: torch.Tensor, teacher: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    same = (vocab_parallel_argmax(student) == vocab_parallel_argmax(teacher)).float()
    return masked_mean(same, loss_mask)
