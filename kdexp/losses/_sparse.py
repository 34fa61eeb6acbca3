"""The two halves of one Top-K / Top-P chunk of the logit KD loss (private: the chunk-kernel layer).

`teacher_half` finds the kept set S of a chunk from the teacher's logits: its global top-K (growing from
TOP_P_INITIAL_K for a nucleus over the whole vocabulary), the nucleus cut with its min-K floor, the teacher's
log-probs on S and its log-residual outside S. kdexp.losses.cached builds the same four values from a cache record
instead. `student_half` takes them and the student's chunk to the loss, the stats and the O(K) values the backward
needs (`StudentHalf`); kdexp.losses._autograd runs both per chunk.

Residual mass: the log-sum-exp of the logits OUTSIDE S (kept entries masked to -inf in a scratch chunk) minus the
full log-sum-exp, both sums of positive terms, rather than log(-expm1(logsumexp(kept log-probs))). That has the
same value, stays accurate to relative precision when the kept mass is within 1e-7 (or 1e-30) of 1, where the expm1
form loses all digits in float32 (its input is the log of a sum that already rounded to 1), keeps a nonzero gradient
there, and is exactly -inf (a zero ghost bucket, dropped) when S is the whole vocabulary. The full log-sum-exp is
assembled from the same two parts, so one pass over the vocabulary per distribution computes both.

The gradient w.r.t. logits/T of the full-normalization loss is, with g = dL/d(kept student log-probs), h =
dL/d(student log-residual), G = sum g + h, q the student softmax, r the student residual:
  i in S:      g_i - q_i G
  i not in S:  exp(s_i - logsumexp_{not S} s) * (h - G r)        (the first factor is <= 1: no overflow)
Under TP each rank computes its own vocabulary slice of exactly that, with no communication in backward, so the
gradient has no factor of the TP size (as in Megatron's vocab-parallel cross-entropy).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from kdexp.losses import _native
from kdexp.losses._chunks import (KDStats, KernelConfig, exp_floor, finite_or_zero, load_, mask_at_, masked_lse_,
                                  scaled)
from kdexp.losses._shard import Shard
from kdexp.losses.divergence import bucket_divergence, xlogdot_

# Top-P without a Top-K bound starts from this many candidates and grows x4 until the nucleus fits.
TOP_P_INITIAL_K = 1024


class SplitGrad(NamedTuple):
    """Forward KL with every candidate kept: dL/d(student logits / T) on S is e w - p, kept as its parts so that the
    backward forms the scaled gradient (plus the fused LM term q gl, q = e / total) in two passes over S instead of
    the forward's two plus the backward's three. e: the student's exps over S (centred, not normalised), w: -G /
    total per row, p: the teacher's kept probabilities, inv_total: 1 / total."""

    e: torch.Tensor
    w: torch.Tensor
    p: torch.Tensor
    inv_total: torch.Tensor


class StudentHalf(NamedTuple):
    """The student half of one sparse chunk: what the forward returns and the backward reads. loss [c]; gidx [c, K]
    the candidates' global ids; keep [c, K] the kept mask (None: all kept); cand_grad the gradient on S (a tensor, or
    SplitGrad for forward KL with every candidate kept); coef (factor, log-sum-exp outside S, student residual) for
    the gradient outside S (None: nothing outside S, renormalised without the LM loss); centre [c] the student's row
    max; exp_sum [c] the row sums of the exps left in the chunk buffer (None when nothing was computed there); lse and
    q the student's full log-sum-exp and kept probabilities (the fused LM loss only, else None); stats (if asked)."""

    loss: torch.Tensor
    gidx: torch.Tensor
    keep: torch.Tensor | None
    cand_grad: torch.Tensor | SplitGrad
    coef: tuple | None
    centre: torch.Tensor
    exp_sum: torch.Tensor | None
    lse: torch.Tensor | None
    q: torch.Tensor | None
    stats: KDStats | None


def teacher_half(teacher, buf, cfg: KernelConfig, shard: Shard, cd, want_stats: bool):
    """The teacher half of one Top-K / Top-P chunk: (global indices of the candidates, kept mask (None: every
    candidate is kept, no nucleus cut), teacher log-probs of the candidates (unnormalised when not needed), teacher
    log-residual outside the kept set or None)."""
    neg_inf = torch.tensor(-math.inf, dtype=cd, device=teacher.device)
    growing = cfg.top_k is None  # Top-P over the whole vocabulary: grow the candidate set until the nucleus fits
    # Renormalised Top-K needs neither full-vocabulary normaliser (only for the stats).
    need_t = cfg.top_p is not None or not cfg.renormalize or want_stats
    k = cfg.top_k if cfg.top_k is not None else min(shard.vocab, max(cfg.min_k, TOP_P_INITIAL_K))
    while True:
        vals, gidx = shard.global_topk(teacher, k, cd, sort=cfg.top_p is not None)
        m_t = vals.amax(1)  # the teacher's global row max: its top-1 is in every global top-k
        vals = scaled(vals - m_t[:, None], cfg.temperature)
        keep = None
        if not need_t:
            a = vals  # unnormalised: only differences within S matter below
            break
        lidx, _ = shard.local_index(gidx)
        xt, offset = load_(buf, teacher, cfg.temperature, m_t)
        lc_t = masked_lse_(mask_at_(xt, lidx), shard, offset)[0]
        lse_t = torch.logsumexp(torch.cat([lc_t[:, None], vals], 1), 1)  # non-candidates + candidates
        a = vals - lse_t[:, None]
        if cfg.top_p is None:
            break
        p = a.double().exp()  # float64 cumsum: the cut must not depend on rounding over thousands of terms
        cum = p.cumsum(1)
        keep = (cum - p < cfg.top_p) | (torch.arange(k, device=a.device) < cfg.min_k)
        if not growing or k >= shard.vocab:
            break
        # The next candidate would be kept iff the mass of all k is still < top_p (small margin for rounding).
        if not shard.any(bool((cum[:, -1] < cfg.top_p + 1e-6).any()), a.device):
            break
        k = min(shard.vocab, 4 * k)
    if need_t and keep is None:  # teacher residual: the non-candidates
        lr_t = lc_t - lse_t
    elif need_t:  # ... plus the candidates outside the nucleus
        lr_t = torch.logsumexp(torch.cat([lc_t[:, None], torch.where(keep, neg_inf, vals)], 1), 1) - lse_t
    if growing:  # keep is a prefix: drop the columns no token keeps (the candidate set may be far wider)
        kk = int(keep.sum(1).max())
        vals, gidx, a, keep = vals[:, :kk], gidx[:, :kk], a[:, :kk], keep[:, :kk]
    return gidx, keep, a, (lr_t if need_t else None)


def student_half(student, buf, cfg: KernelConfig, shard: Shard, cd, want_stats: bool, gidx, keep, a, lr_t, lm=False,
                  held=False):
    """The student half of one Top-K / Top-P chunk, given the teacher half: the loss, stats and the O(K) values the
    backward needs (`lm`: also the student's full log-sum-exp and kept probabilities, for the fused LM loss). `held`:
    `buf` is the chunk's rows of the gradient (holds_gradient), which take the exps outside S."""
    c, vl = student.shape
    neg_inf = torch.tensor(-math.inf, dtype=cd, device=student.device)
    need_s = not cfg.renormalize or want_stats or lm
    fkl = cfg.divergence == "forward_kl" and keep is None and not cfg.renormalize
    # Student: kept logits, centred on the row max (global, all ranks), log-sum-exp outside S. Renormalised without
    # stats only differences within S matter, so the max over S centres them without a pass over the vocabulary.
    lidx, owned = shard.local_index(gidx, keep)
    native = need_s and _native.serves(student, buf if held else None)
    if native:
        # The same values from the CPU kernel, one pass per row (kdexp.losses._native); forward KL's p and
        # sum p (a - b) too. Held path only: no TP, no nucleus cut, float32.
        e, b, p, row = _native.topk_forward(student, lidx, cfg.temperature, buf,
                                            a.contiguous() if fkl else None)
        m_s, lns, exp_sum, lse_s, total, kl = row.unbind(1)
        inv_total = total.reciprocal()
        lr_s = lns - lse_s
    elif shard.world == 1:  # every candidate is on this rank; the ones not kept are masked to -inf just below
        sv = student.gather(1, gidx).to(cd)
    else:  # kept logits gathered from the owning ranks (zeros elsewhere, then SUM: exact)
        sv = shard.all_reduce_(torch.where(owned, student.gather(1, lidx.clamp_max(vl - 1)).to(cd),
                                           torch.zeros((), dtype=cd, device=student.device)))
    if keep is not None:  # (never on the kernel's path: the held gradient has no nucleus cut)
        sv = torch.where(keep, sv, neg_inf)
    a_kept = a if keep is None else torch.where(keep, a, neg_inf)
    if need_s and not native:
        # The student's log-sum-exp outside S, from a raw copy with S masked to -inf. The row max (over all
        # ranks) that centres everything is the larger of the max outside S (this chunk's) and the max over S
        # (the gathered logits): no pass of its own.
        xs = mask_at_(load_(buf, student, 1.0, None)[0], lidx)
        m_loc = xs.amax(1)
        m_s = torch.maximum(shard.all_reduce_(m_loc.clone(), op=dist.ReduceOp.MAX) if shard.world > 1 else m_loc,
                            sv.amax(1))
        m_s = finite_or_zero(m_s)
        lns, _, exp_sum = masked_lse_(xs, shard, m_s, m_loc, cfg.temperature)
        # One exp over S gives the log-sum-exp, the log-probs and the probabilities. The total is >= 1 (the row max
        # is a term, inside S or in exp(lns)), so the floor's exp(floor) per entry (not kept: -inf) is below its
        # rounding, as in masked_lse_.
        sv = scaled(sv.sub_(m_s[:, None]), cfg.temperature)  # in place: sv is this function's own gathered copy
        e = (sv.exp() if keep is None else sv.clamp_min(exp_floor(sv.dtype)).exp_())
        total = e.sum(1).add_(lns.exp())
        lse_s = total.log()
        b = sv.sub_(lse_s[:, None])
        inv_total = total.reciprocal()  # q = exp(b) = e / total; its entries not kept land in the scratch column
        lr_s = lns - lse_s
    elif not need_s:  # renormalised without stats: only differences within S matter, the max over S centres them
        m_s = sv.amax(1)
        b = scaled(sv - m_s[:, None], cfg.temperature)

    q = e.mul_(inv_total[:, None]) if need_s and not fkl else None  # forward KL keeps e and 1 / total (below)
    if cfg.renormalize:
        a_r = a_kept - torch.logsumexp(a_kept, 1, keepdim=True)
        b_r = b - torch.logsumexp(b, 1, keepdim=True)
        loss, g = bucket_divergence(a_r, b_r, keep, cfg.divergence, cfg.beta)
        cand_grad = g - b_r.exp() * g.sum(1, keepdim=True)
        coef = None
        if lm:  # the KD term has nothing outside S; the LM term has
            coef = (torch.zeros_like(lns), finite_or_zero(lns), lr_s.exp())
    else:
        # Forward KL with every candidate kept: g = -p on S, whose sum is minus the teacher's kept mass, 1 - r_t
        # (from its residual's log: no pass over the buckets, and no -p); the loss is sum p (a - b).
        if fkl and native:
            loss = kl
        elif fkl:
            p = a.exp()
            loss = xlogdot_(a.sub_(b), p)  # a is the teacher side's own copy, not read after this
        else:
            loss, g = bucket_divergence(a_kept, b, keep, cfg.divergence, cfg.beta)
        if cfg.ghost:  # the ghost bucket: its term of the same sum. An empty one (S is everything, or the rest is
            # -inf: a masked vocabulary) adds 0 by the 0 log 0 convention; the student's mass there against an empty
            # teacher bucket is +inf in reverse KL, as in the dense loss
            ghost, h = bucket_divergence(lr_t[:, None], lr_s[:, None], None, cfg.divergence, cfg.beta)
            loss, h = loss + ghost, h[:, 0]
        else:
            h = torch.zeros_like(loss)
        if fkl:  # G = -(1 - r_t) + h (-1 with the ghost bucket); dL/ds on S = g - q G = e (-G / total) - p
            gsum = torch.expm1(lr_t) + h
            cand_grad = SplitGrad(e, gsum.neg().mul_(inv_total), p, inv_total)
        else:
            gsum = g.sum(1) + h
            cand_grad = g - q * gsum[:, None]
        # Outside S: dL/ds_i = exp(s_i - lse_notS) (h - G r_s); backward recomputes the first factor from the
        # centre and lse_notS (0 where nothing is outside S: no entry reads it).
        r_s = lr_s.exp()
        coef = (torch.where(torch.isfinite(lns), h - gsum * r_s, torch.zeros_like(lns)), finite_or_zero(lns), r_s)
    stats = None
    if want_stats:
        # kept mass = 1 - residual mass, from the residuals' accurate logs (no pass over the buckets)
        stats = KDStats(teacher_kept_mass=-torch.expm1(lr_t), student_kept_mass=-torch.expm1(lr_s),
                        nucleus_size=(torch.full_like(lr_s, a.shape[1]) if keep is None else keep.sum(1).to(cd)),
                        teacher_residual_mass=lr_t.exp(), student_residual_mass=lr_s.exp())
    # exp_sum: the row sums of the exps masked_lse_ left in `buf` (none when renormalised without stats)
    return StudentHalf(loss, gidx, keep, cand_grad, coef, m_s, exp_sum if need_s else None,
                       lse_s if lm else None, q if lm else None, stats)
