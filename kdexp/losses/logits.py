"""Logit distillation loss: dense, Top-K, Top-P (with a min-K floor), ghost token, temperature, forward/reverse KL, JSD.

`logits_kd_loss` is the one entry point. Per token, with s = student_logits / T and t = teacher_logits / T:
  - log-probs are normalised over the FULL vocabulary, also under tensor parallelism, from logits centred on their
    row max m (over all TP ranks) BEFORE the division by T: log p = (x - m)/T - log(sum(exp((x - m)/T))). Formed
    from uncentred logits, x/T - logsumexp(x/T) is off by about one ulp of max|x/T| (3e-5 around 256): near
    convergence that is the size of the loss and can make it negative. The teacher's m is its global top-1 (in every
    top-k, free); the student's costs one max pass (none for a renormalised Top-K without stats: S's own max);
  - a divergence between proper distributions (dense, ghost bucket, renormalised) is clamped at 0 (the value only);
  - the kept set S is the teacher's global top-K (the whole vocabulary when top_k is None), sorted by teacher
    probability, then cut to the nucleus prefix where cumsum(p) - p < top_p (always at least min_k entries);
  - normalization="full": the divergence runs over S, plus (ghost_token=True) one bucket holding each distribution's
    residual mass 1 - sum_S p, so that the K+1 buckets form proper distributions;
    normalization="renormalize": both distributions are re-normalised over S alone (ModelOpt's pre-upgrade Top-K
    behaviour), which cannot be combined with a ghost bucket.

How it is computed (chunk by chunk over tokens; the [tokens, vocab] float32 copies never exist whole) lives in the
private chunk-kernel layer: kdexp.losses._chunks (centred loads, log-sum-exps, labels; the chunk heights are
kdexp.losses.chunking's),
kdexp.losses._sparse (the teacher and student halves of a Top-K / Top-P chunk, the residual mass and the gradient
formulas) and kdexp.losses._autograd (the autograd Function, dense and sparse, with the held-gradient path).
kdexp.losses.cached is the same loss with the teacher half read from a cache record.
"""

from __future__ import annotations

import torch

from kdexp.losses._autograd import LogitsKD
from kdexp.losses._chunks import KDStats, check_labels, holds_gradient, make_cfg, shaped
from kdexp.losses._shard import Shard
from kdexp.losses._sparse import TOP_P_INITIAL_K

# What callers outside the losses use: the loss, its stats, and the rules kdexp.plan sizes it by (its chunk heights:
# kdexp.losses.chunking).
__all__ = ["logits_kd_loss", "KDStats", "holds_gradient", "TOP_P_INITIAL_K"]


def _check_tensors(student, teacher):
    if not isinstance(student, torch.Tensor) or not isinstance(teacher, torch.Tensor):
        raise ValueError("student_logits and teacher_logits must be tensors")
    if student.dim() < 1 or student.shape[-1] < 1:
        raise ValueError(f"student_logits must have a vocabulary dimension of size >= 1, got {tuple(student.shape)}")
    if student.shape[-1] != teacher.shape[-1]:
        raise ValueError(
            f"student/teacher vocabulary mismatch: student_logits has vocabulary size {student.shape[-1]}, "
            f"teacher_logits has {teacher.shape[-1]} (shapes {tuple(student.shape)} vs {tuple(teacher.shape)})"
        )
    if student.shape != teacher.shape:
        raise ValueError(
            f"student/teacher shape mismatch: student_logits {tuple(student.shape)} vs teacher_logits "
            f"{tuple(teacher.shape)}"
        )
    if not (student.is_floating_point() and teacher.is_floating_point()):
        raise ValueError(f"logits must be floating point, got {student.dtype} and {teacher.dtype}")


def logits_kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_k: int = 1,
    ghost_token: bool = True,
    normalization: str = "full",
    divergence: str = "forward_kl",
    tp_group=None,
    return_stats: bool = False,
    beta: float = 0.5,
    scale_by_temperature_squared: bool = False,
    chunk_tokens: int | None = None,
    labels: torch.Tensor | None = None,
):
    """Per-token distillation loss, shape `student_logits.shape[:-1]`, float32 (float64 for float64 inputs).

    student_logits / teacher_logits: [..., V] (under `tp_group`: this rank's contiguous vocabulary shard, rank
    order, as Megatron's vocab-parallel output layer gives it; the loss is then the unsharded value on every rank and
    each rank's gradient is its slice of the unsharded gradient). Gradient flows to student_logits only.
    top_k: teacher's global top-K candidates (None = whole vocabulary). top_p: nucleus cut in (0, 1] over the sorted
    candidates (1.0 = no cut); with top_k=None it is a true nucleus over the whole vocabulary. min_k: entries always
    kept. ghost_token: add the residual-mass bucket (normalization="full" only). divergence: "forward_kl" (KL(P_t||P_s)),
    "reverse_kl" (KL(P_s||P_t)) or "jsd" (generalized, weight `beta` on the teacher). scale_by_temperature_squared:
    multiply by T^2 (Hinton et al.); off by default. chunk_tokens: tokens per chunk (default: a working set of at
    most ~1/16 of one fp32 [tokens, vocab] tensor, between 4 and 64 MiB). return_stats=True returns (loss, KDStats).
    labels [...] (global vocabulary ids; sparse loss at T = 1 only): also the student's per-token LM cross-entropy
    -log softmax(student)[label] (megatron's vocab-parallel cross-entropy, its gradient added in the same backward),
    computed in the KD loss's own pass over the vocabulary: `loss` is then the pair (kd, lm).
    """
    _check_tensors(student_logits, teacher_logits)
    local_vocab = student_logits.shape[-1]
    shard = Shard.make(local_vocab, tp_group, student_logits.device)
    cfg = make_cfg(shard.vocab, temperature=temperature, top_k=top_k, top_p=top_p, min_k=min_k, ghost_token=ghost_token,
                   normalization=normalization, divergence=divergence, beta=beta,
                   scale_by_temperature_squared=scale_by_temperature_squared, chunk_tokens=chunk_tokens)
    stats: list | None = [] if return_stats else None
    out = LogitsKD.apply(student_logits.reshape(-1, local_vocab), teacher_logits.detach().reshape(-1, local_vocab),
                         cfg, shard, stats, None, check_labels(labels, cfg, student_logits))
    return shaped(out, stats[0] if return_stats else None, student_logits.shape[:-1])
