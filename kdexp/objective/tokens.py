"""Per-token quantities the objective weighs, on this rank's vocabulary shard ([..., V/tp]): the one vocab-parallel
cross-entropy, token normalisation, the hidden-state losses and the evaluation metrics. Every function returns
values that are equal on every TP rank.

Token normalisation follows Megatron: with ``denom`` (see ``token_share``) a micro-batch returns its masked token sum
over the tokens of the whole global batch, so the values of a step's micro-batches add up to the global-batch mean;
without it, the micro-batch's own masked mean.

Hidden-state losses (``loss.intermediate``) are modules attached to the student (``attach_intermediate``), so their
projections are trained, clipped, averaged over DP and checkpointed with it (and left out of the Hugging Face
export).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from kdexp import distributed
from kdexp.losses import logits_kd_loss
from kdexp.losses.intermediate import IntermediateLoss, mean_of

INTERMEDIATE_ATTR = "kdexp_intermediate"  # kdexp.models.hf.TRAINING_ONLY_PREFIX keeps it out of the HF export


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denom=None) -> torch.Tensor:
    """Masked sum over `denom` tokens; None = this batch's own count (its masked mean)."""
    return (values.float() * mask).sum() / (mask.sum().clamp(min=1.0) if denom is None else denom)


def token_share(micro_batches: list[dict], group=None, group_size: int = 1) -> torch.Tensor:
    """This rank's denominator for the token normalisation of one global batch: the loss-mask tokens of all its
    micro-batches summed over the `group` (the data-parallel ranks), divided by `group_size`.

    Why divided: the gradients are then averaged over the group (as megatron's DDP does), so `group_size` ranks'
    sums over `tokens / group_size` average to the sum over all tokens of the global batch. With one micro-batch on
    one rank this is exactly masked_mean's own denominator."""
    total = torch.stack([b["loss_mask"].sum() for b in micro_batches]).sum()
    if group_size > 1:
        dist.all_reduce(total, group=group)
    total = total.clamp(min=1.0)
    return total / group_size if group_size > 1 else total


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Megatron's vocab-parallel next-token cross-entropy per token (logits [..., V/tp], labels [...]). Megatron's
    works in place, so it never runs on the caller's tensor: the KD loss may still read those logits."""
    x = logits.float()
    if x is logits:
        x = logits.clone()
    return tensor_parallel.vocab_parallel_cross_entropy(x, labels)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, denom=None) -> torch.Tensor:
    """The LM loss: `cross_entropy`'s masked mean over tokens (or over `denom`)."""
    return masked_mean(cross_entropy(logits, labels), loss_mask, denom)


def intermediate_layers(loss_cfg) -> tuple[list[int], list[int]]:
    """The student and the teacher decoder layers whose outputs the hidden-state losses read."""
    pairs = loss_cfg.intermediate or []
    return [p.student for p in pairs], [p.teacher for p in pairs]


def attach_intermediate(student: torch.nn.Module, loss_cfg, teacher_hidden: int) -> None:
    """One IntermediateLoss per loss.intermediate pair, attached to the student (before its optimizer is made),
    with a projection student_hidden -> teacher_hidden when the sizes differ (initialised from torch's RNG, the
    same on every TP rank after distributed.reseed; the hidden states are replicated over TP, so are its grads)."""
    pairs = loss_cfg.intermediate or []
    if not pairs:
        return
    hidden = student.kdexp_spec.hidden_size
    device = next(student.parameters()).device
    modules = torch.nn.ModuleList(IntermediateLoss(p.kind, hidden, teacher_hidden) for p in pairs).to(device)
    setattr(student, INTERMEDIATE_ATTR, modules)


def intermediate_loss(student: torch.nn.Module, loss_cfg, student_hidden: dict, teacher_hidden: dict,
                      loss_mask: torch.Tensor, denom=None) -> torch.Tensor:
    """Mean over the pairs of each pair's masked-mean per-token loss (hidden states [s, b, h], the mask [b, s]). The
    balancer adds it to the KD term rescaled to |logit KD loss| (kdexp.losses.balancers: ModelOpt's convention)."""
    modules = getattr(student, INTERMEDIATE_ATTR)
    losses = [masked_mean(m(student_hidden[p.student].transpose(0, 1), teacher_hidden[p.teacher].transpose(0, 1)),
                          loss_mask, denom) for m, p in zip(modules, loss_cfg.intermediate)]
    return mean_of(losses)


def full_kl(student: torch.Tensor, teacher: torch.Tensor, loss_mask: torch.Tensor, denom=None) -> torch.Tensor:
    """Full-vocabulary forward KL(teacher || student) at T=1: the eval metric val/kl_to_teacher."""
    per_token = logits_kd_loss(student, teacher, top_k=None, top_p=None, ghost_token=False,
                               tp_group=distributed.tp_group())
    return masked_mean(per_token, loss_mask, denom)


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


def top1_agreement(student: torch.Tensor, teacher: torch.Tensor, loss_mask: torch.Tensor, denom=None) -> torch.Tensor:
    same = (vocab_parallel_argmax(student) == vocab_parallel_argmax(teacher)).float()
    return masked_mean(same, loss_mask, denom)
