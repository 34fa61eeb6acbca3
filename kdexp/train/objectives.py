"""The objective's building blocks on vocab-parallel logits: token normalisation, LM cross-entropy, the balancer, the
hidden-state losses and the eval metrics. The KD objective itself (which loss, which teacher) is built once in
kdexp.train.objective; the balancer through its one factory (`BalancerOptions.from_config(...).build()`). Hidden-state losses
(`loss.intermediate`) are modules attached to the student (`attach_intermediate`), so their projections are trained,
clipped, averaged over DP and checkpointed with it (and left out of the Hugging Face export).

Every function takes this rank's vocabulary shard ([b, s, V/tp]) and returns values that are equal on every TP rank.
Token normalisation follows Megatron: with ``denom`` (see ``token_share``) a micro-batch returns its masked token sum
over the tokens of the whole global batch, so the values of a step's micro-batches add up to the global-batch mean;
without it, the micro-batch's own masked mean.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from kdexp import distributed
from kdexp.losses import BalancerOptions, logits_kd_loss
from kdexp.losses.intermediate import IntermediateLoss, mean_of
from kdexp.losses.sampled import step_seed

INTERMEDIATE_ATTR = "kdexp_intermediate"  # kdexp.models.hf.TRAINING_ONLY_PREFIX keeps it out of the HF export


def batch_to(batch: dict, device) -> dict:
    """The fields the objectives read, on the device (position ids are rebuilt by the model code, not copied);
    sample_index (the key into an offline teacher cache) stays on the host."""
    out = {k: batch[k].to(device, non_blocking=True) for k in ("tokens", "labels", "loss_mask")}
    if "sample_index" in batch:
        out["sample_index"] = batch["sample_index"]
    return out


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denom=None) -> torch.Tensor:
    """Masked sum over `denom` tokens; None = this batch's own count (its masked mean)."""
    return (values.float() * mask).sum() / (mask.sum().clamp(min=1.0) if denom is None else denom)


def token_share(micro_batches: list[dict], group=None, group_size: int = 1) -> torch.Tensor:
    """This rank's denominator for the token normalisation of one global batch: the loss-mask tokens of all its
    micro-batches summed over the `group` (the data-parallel ranks), divided by `group_size`.

    Why divided: the gradients are then averaged over the group (as megatron's DDP does), so `group_size` ranks'
    sums over `tokens / group_size` average to the sum over all tokens of the global batch. With one micro-batch on
    one rank this is exactly masked_mean's own denominator (the default path's numbers do not move)."""
    total = torch.stack([b["loss_mask"].sum() for b in micro_batches]).sum()
    if group_size > 1:
        dist.all_reduce(total, group=group)
    total = total.clamp(min=1.0)
    return total / group_size if group_size > 1 else total


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, denom=None) -> torch.Tensor:
    """Vocab-parallel next-token cross-entropy (Megatron's), masked mean over tokens (or over `denom`)."""
    x = logits.float()
    if x is logits:  # megatron's cross-entropy works in place; keep the caller's logits intact for the KD loss
        x = logits.clone()
    return masked_mean(tensor_parallel.vocab_parallel_cross_entropy(x, labels), loss_mask, denom)


def build_balancer(balancer_cfg):
    """The balancer a config's `balancer` node describes (its value rules checked first)."""
    return BalancerOptions.from_config(balancer_cfg).build()


def sampling_seed(cfg, step: int, micro: int = 0) -> int:
    """The sampled-KD seed of micro-batch `micro` of a (0-based) training step on this data-parallel rank: from
    trainer.seed, the step and the micro-batch only, so a resumed run draws exactly what the uninterrupted one drew
    and no two micro-batches of a step (or DP ranks) reuse a stream."""
    st = distributed.state()
    return step_seed(cfg.trainer.seed, step, st.dp_rank + st.dp_size * micro)


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
