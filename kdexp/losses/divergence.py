"""Divergences between a teacher and a student distribution, with their gradient w.r.t. the student's log-probs.

Two shapes of input:
- `bucket_divergence`: O(K) buckets per token (the kept set S, plus an optional ghost bucket for the residual mass),
  given as log-probabilities with a validity mask.
- `dense_forward_` / `dense_backward_`: the whole (local shard of the) vocabulary of one chunk, computed in place on
  scratch buffers so that no extra full-vocabulary copies are made.

Conventions: `a` = teacher log-probs, `b` = student log-probs, p = exp(a), q = exp(b); 0 log 0 = 0 (a -inf log-prob,
a masked or padded vocabulary entry, adds exactly 0 where its probability weighs the term, +inf where the other
distribution's does: KL with mass where the other has none).
  forward_kl  L = sum p (a - b)                      dL/db = -p
  reverse_kl  L = sum q (b - a)                      dL/db = q (b - a + 1)
  jsd(beta)   m = log(beta p + (1 - beta) q)
              L = beta sum p (a - m) + (1 - beta) sum q (b - m)
              dL/db = (1 - beta) q (b - m)
The generalized JSD follows the GKD paper's definition (Agarwal et al. 2024, as in TRL's `generalized_jsd_loss`):
beta weights the teacher in the mixture and in the sum; beta = 0.5 is the symmetric Jensen-Shannon divergence.
"""

from __future__ import annotations

import math

import torch


def _xd(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x * d with 0 where x == 0: the 0 log 0 = 0 convention. A -inf log-prob (a masked or padded vocabulary entry,
    probability exactly 0) makes d infinite or NaN, and 0 * inf is NaN; where x > 0 an infinite d stays infinite
    (mass where the other distribution has none: the divergence is +inf)."""
    return torch.where(x == 0, torch.zeros((), dtype=d.dtype, device=d.device), x * d)


def bucket_divergence(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None, divergence: str, beta: float):
    """Per-token divergence over buckets and dL/db. a, b: [c, B] log-probs; valid: [c, B] bool, or None when every
    bucket is valid (no masking passes). Invalid buckets (not kept, or an empty ghost) contribute exactly zero to the
    loss and to the gradient; so does a bucket whose probability is 0 in the distribution that weighs it (0 log 0 =
    0: a -inf log-prob is exact, not NaN). The divergence is a sum of per-bucket terms: buckets may be split over
    calls."""
    if valid is None:
        a0, b0, w = a, b, None
    else:
        zero = a.new_zeros(())
        a0 = torch.where(valid, a, zero)
        b0 = torch.where(valid, b, zero)
        w = valid.to(a.dtype)

    def masked(x):
        return x if w is None else x.mul_(w)

    if divergence == "forward_kl":
        p = masked(a0.exp())
        return _xd(p, a0 - b0).sum(-1), -p
    if divergence == "reverse_kl":
        q = masked(b0.exp())
        d = b0 - a0
        return _xd(q, d).sum(-1), _xd(q, d + 1.0)
    p = masked(a0.exp())
    q = masked(b0.exp())
    m = torch.logaddexp(a0 + math.log(beta), b0 + math.log1p(-beta))
    qbm = _xd(q, b0 - m)
    loss = beta * _xd(p, a0 - m).sum(-1) + (1.0 - beta) * qbm.sum(-1)
    return loss, (1.0 - beta) * qbm


def xlogdot_(d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum(x * d, -1) per row with 0 where x == 0 (0 log 0 = 0; see _xd), overwriting d: no [c, V] temporary, and
    torch.sum's cascade summation (a BLAS dot accumulates 150k float32 terms far less accurately)."""
    return d.masked_fill_(x == 0, 0.0).mul_(x).sum(-1)


def dense_forward_(a: torch.Tensor, b: torch.Tensor, divergence: str, beta: float):
    """Local partial sums over the vocabulary of one chunk. a, b: [c, V_local] GLOBAL log-probs, DESTROYED.

    Returns [c, 2]: column 0 = partial loss, column 1 = the auxiliary sum the backward needs (jsd: sum q (b - m)).
    The caller all-reduces it over the TP group.
    """
    out = a.new_zeros(a.shape[0], 2)
    if divergence == "forward_kl":
        d = torch.sub(a, b, out=b)
        out[:, 0] = xlogdot_(d, a.exp_())
    elif divergence == "reverse_kl":
        d = torch.sub(b, a, out=a)
        out[:, 0] = xlogdot_(d, b.exp_())
    else:
        m = torch.logaddexp(a + math.log(beta), b + math.log1p(-beta))
        t = a - m
        out[:, 0] = beta * xlogdot_(t, a.exp_())
        torch.sub(b, m, out=t)
        kqm = xlogdot_(t, b.exp_())
        out[:, 0] += (1.0 - beta) * kqm
        out[:, 1] = kqm
    return out


def dense_backward_(a: torch.Tensor, b: torch.Tensor, loss, aux, divergence: str, beta: float):
    """dL/d(logits/T) of one chunk from GLOBAL log-probs a, b ([c, V_local], DESTROYED); written into b.

    With dL/ds_i = g_i - q_i sum_j g_j (softmax chain rule) the sums have closed forms:
      forward_kl: q - p;   reverse_kl: q (b - a - L);   jsd: (1 - beta) q (b - m - sum q (b - m)).
    """
    if divergence == "forward_kl":
        return b.exp_().sub_(a.exp_())
    if divergence == "reverse_kl":
        a.neg_().add_(b).sub_(loss[:, None])  # b - a - L
        q = b.exp_()
        return q.mul_(a.masked_fill_(q == 0, 0.0))  # q = 0: no gradient (0 * inf where both are -inf)
    m = torch.logaddexp(a + math.log(beta), b + math.log1p(-beta))
    m.neg_().add_(b).sub_(aux[:, None])  # b - m - K
    q = b.exp_()
    return q.mul_(m.masked_fill_(q == 0, 0.0)).mul_(1.0 - beta)
