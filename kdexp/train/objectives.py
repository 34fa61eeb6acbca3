"""Per-batch objectives on vocab-parallel logits: LM cross-entropy, the KD loss, the balancer, and eval metrics.

The loss and the balancer are built from their config nodes here, each through its one factory in kdexp.losses
(`KDLossOptions.from_config(...).kwargs()`, `BalancerOptions.from_config(...).build()`). `kd_loss` is the one place
that picks the KD estimator of an online teacher: the logit loss, or sampled KD when `loss.samples` is set;
`cached_kd_loss` the one for an offline teacher cache (its top-K record, or its stored draws). Hidden-state losses
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
from kdexp.losses import BalancerOptions, KDLossOptions, logits_kd_loss
from kdexp.losses import cached_kd_loss as cached_kd_loss_fn
from kdexp.losses.intermediate import IntermediateLoss, mean_of
from kdexp.losses.options import SampledKDOptions
from kdexp.losses.sampled import TokenSamples, sample_teacher, sampled_kd_loss, step_seed, unique_mass, weigh

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


def fuses_lm(loss_cfg) -> bool:
    """Whether the step takes its LM loss from the KD loss's own pass over the student's vocabulary (`labels=` of
    kd_loss / cached_kd_loss): a Top-K / Top-P or sampled loss at temperature 1 (KDLossOptions.fuses_lm). Then no
    separate cross-entropy runs: no fp32 copy of the logits, no second softmax, no [tokens, V] softmax saved."""
    return KDLossOptions.from_config(loss_cfg).fuses_lm(sampled=SampledKDOptions.from_config(loss_cfg).enabled)


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, loss_mask: torch.Tensor, loss_cfg, denom=None, *,
            seed: int = 0, labels=None):
    """Masked-mean KD loss and its masked-mean stats, logged as train/kept_mass (the teacher's mass in the kept set),
    train/ghost_mass (the student's mass outside it: its ghost bucket) and train/nucleus_size.

    With `loss.samples` set: sampled KD, drawing from the generator seeded by `seed` (`sampling_seed`); the loss is
    the forward-KL estimate, kept_mass the teacher's mass on the distinct drawn ids, nucleus_size their number.
    With `labels` (only where fuses_lm(loss_cfg)): (kd, stats, lm), lm the masked-mean LM loss of the same pass,
    equal to lm_loss's."""
    sampled = SampledKDOptions.from_config(loss_cfg)
    if sampled.enabled:
        return _sampled(student, teacher, loss_mask, KDLossOptions.from_config(loss_cfg), sampled, seed, denom,
                        labels)
    out = logits_kd_loss(student, teacher, tp_group=distributed.tp_group(), return_stats=True, labels=labels,
                         **KDLossOptions.from_config(loss_cfg).kwargs())
    return _masked_parts(*out, loss_mask, denom)


def _masked_parts(per_token, stats, loss_mask, denom=None):
    """(kd, stats) of per-token values; (kd, stats, lm) when `per_token` is the fused (kd, lm) pair."""
    if isinstance(per_token, tuple):
        return *_masked_parts(per_token[0], stats, loss_mask, denom), masked_mean(per_token[1], loss_mask, denom)
    loss = masked_mean(per_token, loss_mask, denom)
    return loss, {
        "kept_mass": masked_mean(stats.teacher_kept_mass, loss_mask, denom),
        "ghost_mass": masked_mean(stats.student_residual_mass, loss_mask, denom),
        "nucleus_size": masked_mean(stats.nucleus_size.float(), loss_mask, denom),
    }


def sampling_seed(cfg, step: int, micro: int = 0) -> int:
    """The sampled-KD seed of micro-batch `micro` of a (0-based) training step on this data-parallel rank: from
    trainer.seed, the step and the micro-batch only, so a resumed run draws exactly what the uninterrupted one drew
    and no two micro-batches of a step (or DP ranks) reuse a stream."""
    st = distributed.state()
    return step_seed(cfg.trainer.seed, step, st.dp_rank + st.dp_size * micro)


def _sampled(student, teacher, loss_mask, kd: KDLossOptions, sampled: SampledKDOptions, seed: int, denom=None,
             labels=None):
    draw = sample_teacher(teacher, samples=sampled.samples, proposal_temperature=sampled.proposal_temperature,
                          temperature=kd.temperature, seed=seed, normalize=sampled.normalize_weights,
                          tp_group=distributed.tp_group())
    return _sampled_parts(student, draw, loss_mask, kd, denom, labels)


def _sampled_parts(student, draw: TokenSamples, loss_mask, kd: KDLossOptions, denom=None, labels=None):
    """The sampled-KD loss and stats from drawn ids and weights (online draws, or a cache's, reweighed); with
    `labels` also the fused LM loss: (kd, stats, lm)."""
    tp = distributed.tp_group()
    out = sampled_kd_loss(student, draw.ids, draw.weights, draw.teacher_logprobs, temperature=kd.temperature,
                          scale_by_temperature_squared=kd.scale_by_temperature_squared, tp_group=tp, labels=labels)
    mass, distinct = unique_mass(draw)
    stats = {"kept_mass": masked_mean(mass, loss_mask, denom),
             "nucleus_size": masked_mean(distinct.float(), loss_mask, denom)}
    if labels is None:
        return masked_mean(out, loss_mask, denom), stats
    return masked_mean(out[0], loss_mask, denom), stats, masked_mean(out[1], loss_mask, denom)


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


def cached_kd_loss(student: torch.Tensor, cache, sample_index, loss_mask: torch.Tensor, loss_cfg, denom=None, *,
                   labels=None):
    """`kd_loss` with the teacher read from an offline cache (kdexp.teacher.TeacherCache) at the loss's temperature:
    from a "topk" record the same loss, gradient and stats (kdexp.losses.cached_kd_loss); from a "sampled" record
    (loss.samples set) sampled KD on the draws made when the cache was built, weighed here at the loss temperature
    and loss.normalize_weights (kdexp.losses.sampled.weigh): `kd_loss`'s sampled estimator on fixed draws. `labels`
    as in kd_loss."""
    opts = KDLossOptions.from_config(loss_cfg)
    sampled = SampledKDOptions.from_config(loss_cfg)
    record = cache.layout.record
    if sampled.enabled != (record == "sampled"):  # the cache key follows the config: only a caller's mix-up
        raise ValueError(f"loss.samples={sampled.samples!r} cannot be served by the teacher cache {cache.path}: it "
                         f"holds {record!r} records")
    if sampled.enabled:
        draws = cache.read(sample_index, opts.temperature, device=student.device)
        draw = weigh(draws, temperature=opts.temperature, proposal_temperature=cache.layout.proposal_temperature,
                     normalize=sampled.normalize_weights)
        return _sampled_parts(student, draw, loss_mask, opts, denom, labels)
    values, indices, lse, lse_rest = cache.read(sample_index, opts.temperature, device=student.device)
    out = cached_kd_loss_fn(student, values, indices, lse, lse_rest, tp_group=distributed.tp_group(),
                            return_stats=True, labels=labels, **opts.kwargs())
    return _masked_parts(*out, loss_mask, denom)


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
