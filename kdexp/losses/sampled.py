"""Sampled KD (RS-KD; Anshumann et al. 2025, "Sparse Logit Sampling", arXiv 2503.16870), vocab-parallel aware.

Per token, `samples` ids are drawn with replacement from the teacher's proposal q = softmax(t / proposal_temperature)
and kept as (unique ids, counts). The sparse target puts the importance weight w_i = c_i * p_i / q_i on each drawn id
(p = softmax(t / temperature), the distribution the student is distilled towards), normalised to sum 1 as the paper
does, and the student is trained with the cross-entropy -sum_i w_i log s_i (s = softmax(z / temperature) over the whole
vocabulary). Its gradient w.r.t. z / T is (sum_i w_i) s - w (scattered onto the drawn ids). With
proposal_temperature == temperature every weight is c_i / samples, so E[w] = p and the gradient equals the full
forward-KL gradient s - p in expectation (exactly unbiased, tests/test_sampled.py checks it statistically); with another
proposal the self-normalised weights are consistent, with a bias of order 1/samples; `normalize=False`
(loss.normalize_weights=false) keeps the plain importance weights (c_i / samples) p_i / q_i instead, unbiased for any
proposal at a higher variance.

Entry points, so that an offline cache can store the draws and feed them back:
  - `sample_teacher(teacher_logits, samples=..., proposal_temperature=..., temperature=..., seed=...)` ->
    `TokenSamples(ids, counts, weights, teacher_logprobs)`, each [..., samples] (unused slots: count 0, weight 0);
    it is `weigh(draw_teacher(...))`:
  - `draw_teacher(teacher_logits, samples=..., proposal_temperature=..., temperatures=[...], seed=...)` ->
    `TeacherDraws(ids, counts, centred, log_zp, log_zq)`: the draws and what weighs them at any of `temperatures`
    (the teacher cache's "sampled" record, kdexp.teacher.format), and `weigh(draws, temperature=..., ...)` ->
    `TokenSamples`, the one place that turns them into importance weights and log p;
  - `sampled_kd_loss(student_logits, ids, weights, teacher_logprobs=None, temperature=...)` -> per-token loss.
The loss VALUE is sum_i w_i (log p_i - log s_i): an estimate of the full-vocabulary forward KL(p || s) (unbiased at
proposal_temperature == temperature); without teacher log-probs it is the sparse cross-entropy (the KL plus the
teacher entropy estimate), whose gradient is the same.

Determinism and TP: the uniforms of a step come from a CPU torch.Generator seeded by `step_seed(seed, step, dp_rank)`
(the same on every TP rank, a new stream per step, so a resumed run draws what the uninterrupted one drew), sorted per
row, and inverted through the cumulative proposal mass in float64: rank r owns the draws that fall in its slice of the
cumulative mass (the rank totals are all-gathered) and resolves them with a local cumsum + searchsorted; one
all-reduce shares the ids. TP=1 and TP=2 therefore make the same draws, up to float64 rounding of the cumulative sums
(a draw within ~1e-16 of a bucket edge): no difference in practice. Cost: one float32 exp and one float64 cumsum over
the vocabulary per token, a searchsorted per draw.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from kdexp.losses import _native
from kdexp.losses._chunks import Labels, check_label_shape, load_, lse_
from kdexp.losses._shard import Shard, check_ids
from kdexp.losses.chunking import sampled_rows
from kdexp.losses.options import KDLossOptions
from kdexp.rules import is_real



class TokenSamples(NamedTuple):
    """Draws per token, [..., samples] each: unique ids first (sorted), then unused slots (count 0, weight 0)."""

    ids: torch.Tensor  # int64 global vocabulary ids
    counts: torch.Tensor  # int64 how many of the draws hit each id
    weights: torch.Tensor  # normalised importance weights c * p / q (sum 1 per token)
    teacher_logprobs: torch.Tensor  # log p at the loss temperature (for the loss value)


def step_seed(seed: int, step: int, dp_rank: int = 0) -> int:
    """The generator seed of one training step on one data-parallel rank (TP ranks share it): a fixed mix of the
    three, so each step draws a fresh stream and a resumed run draws what the uninterrupted run drew."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + int(dp_rank) * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def _compact(ids: torch.Tensor):
    """Sorted draws [n, S] -> (unique ids, counts) packed to the left, same width; unused slots repeat the first id."""
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run = first.long().cumsum(1) - 1
    counts = torch.zeros_like(ids).scatter_add_(1, run, torch.ones_like(ids))
    unique = ids[:, :1].expand_as(ids).clone().scatter_(1, run, ids)  # equal values per run: order does not matter
    return unique, counts


class TeacherDraws(NamedTuple):
    """What `draw_teacher` leaves to weigh, per token: everything `weigh` needs for any loss temperature, and what an
    offline cache stores ("sampled" records, kdexp.teacher.format). [..., samples] each unless noted."""

    ids: torch.Tensor  # int64 unique global ids (sorted), then unused slots (they repeat the first id)
    counts: torch.Tensor  # int64 draws per id; 0 = unused slot
    centred: torch.Tensor  # the teacher's logit of each id minus its row max (float64; 0 in unused slots)
    log_zp: torch.Tensor  # [..., n] log sum_v exp(centred_v / T) over the vocabulary for each temperature T asked for
    log_zq: torch.Tensor  # [...] the proposal's: log sum_v exp(centred_v / proposal_temperature)


class LogitRows(NamedTuple):
    """Teacher logits formed on demand, never whole: `rows(slice)` -> [c, V/tp] of `n` tokens (no grad; the fused
    head's teacher, kdexp.losses.head.teacher_head_logits). draw_teacher / sample_teacher take it in place of a
    [n, V/tp] tensor and draw the same ids from it."""

    n: int
    local_vocab: int
    dtype: torch.dtype
    device: torch.device
    rows: Callable[[slice], torch.Tensor]


@torch.no_grad()
def draw_teacher(teacher_logits, *, samples: int, proposal_temperature: float = 1.0,
                 temperatures=(1.0,), seed: int = 0, tp_group=None) -> TeacherDraws:
    """Draw `samples` ids per token from softmax(teacher_logits / proposal_temperature) over the global vocabulary
    (this rank holds the contiguous shard [.., V/tp]); deterministic in `seed`, the same on every TP rank. The draws
    do not depend on `temperatures`: those only add the log-normalisers of p = softmax(teacher / T) (one more pass
    over the vocabulary per T that differs from the proposal's). `teacher_logits`: a tensor [..., V/tp], or LogitRows
    (read chunk by chunk of rows; the uniforms are drawn per token up front, so the ids are those of the tensor)."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
    temps = [float(t) for t in temperatures]
    for name, v in (("proposal_temperature", proposal_temperature), *(("temperature", t) for t in temps)):
        if not (is_real(v) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    if not temps:
        raise ValueError("temperatures must list at least one temperature")
    if isinstance(teacher_logits, LogitRows):
        lead, n, vl = (teacher_logits.n,), teacher_logits.n, teacher_logits.local_vocab
        device, dtype, get = teacher_logits.device, teacher_logits.dtype, teacher_logits.rows
    else:
        lead = teacher_logits.shape[:-1]
        t_all = teacher_logits.reshape(-1, teacher_logits.shape[-1])
        (n, vl), device, dtype = t_all.shape, t_all.device, t_all.dtype

        def get(r: slice) -> torch.Tensor:
            return t_all[r]
    shard = Shard.make(vl, tp_group, device)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    u_all = torch.rand(n, samples, generator=gen, dtype=torch.float64).sort(dim=1).values.to(device)
    ids_all = torch.empty(n, samples, dtype=torch.long, device=device)
    logit_all = torch.empty(n, samples, dtype=torch.float64, device=device)
    log_zq_all = torch.empty(n, dtype=torch.float64, device=device)
    log_zp_all = torch.empty(n, len(temps), dtype=torch.float64, device=device)
    rows = sampled_rows(n, vl * 8 * 3)
    # The proposal's terms exp((t - m) / T_q) in float32 (float64 for float64 logits): elementwise, so identical on
    # every TP size; their running sum in float64, so that tail probabilities far below float32's epsilon stay exact.
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    for lo in range(0, n, rows):
        t = get(slice(lo, min(n, lo + rows))).to(wdtype)
        m = shard.row_max(t, wdtype)[:, None]  # global max: the same on every rank
        w = t.sub(m).div_(proposal_temperature).exp_()
        cum = torch.cumsum(w, 1, dtype=torch.float64)
        del w
        totals = cum[:, -1].contiguous()
        if shard.world > 1:
            parts = [torch.empty_like(totals) for _ in range(shard.world)]
            torch.distributed.all_gather(parts, totals, group=shard.group)
            rank_cum = torch.stack(parts, 1).cumsum(1)  # [c, tp]: end of each rank's slice of the cumulative mass
        else:
            rank_cum = totals[:, None]
        z = rank_cum[:, -1:]
        target = u_all[lo:lo + rows] * z
        owner = torch.searchsorted(rank_cum, target, right=True).clamp_(max=shard.world - 1)
        start = torch.cat([torch.zeros_like(z), rank_cum[:, :-1]], 1).gather(1, owner)
        local = torch.searchsorted(cum, target - start, right=True).clamp_(max=vl - 1)
        mine = owner == shard.rank
        gid = torch.where(mine, local + shard.offset, torch.zeros_like(local))
        logit = torch.where(mine, t.gather(1, local).double(), torch.zeros_like(target))
        packed = torch.stack([gid.double(), logit], -1)  # one all-reduce: float64 holds the ids exactly
        shard.all_reduce_(packed)
        ids_all[lo:lo + rows] = packed[..., 0].long()
        logit_all[lo:lo + rows] = packed[..., 1] - m.double()
        log_zq_all[lo:lo + rows] = z.squeeze(1).log()
        for j, temp in enumerate(temps):  # p's normaliser: q's when the temperatures agree (no second pass)
            log_zp_all[lo:lo + rows, j] = log_zq_all[lo:lo + rows] if temp == proposal_temperature else \
                shard.logsumexp_(torch.logsumexp((t - m).double() / temp, dim=1))
    ids, counts = _compact(ids_all)
    # The centred teacher logit of each unique id (its first draw's).
    first_pos = torch.cat([torch.zeros_like(counts[:, :1]), counts.cumsum(1)[:, :-1]], 1).clamp_(max=samples - 1)
    centred = logit_all.gather(1, first_pos)
    centred = torch.where(counts > 0, centred, torch.zeros_like(centred))
    shape = (*lead, samples)
    return TeacherDraws(ids.reshape(shape), counts.reshape(shape), centred.reshape(shape),
                        log_zp_all.reshape(*lead, len(temps)), log_zq_all.reshape(lead))


def weigh(draws: TeacherDraws, *, temperature: float, proposal_temperature: float, normalize: bool = True,
          temperature_index: int = 0, dtype: torch.dtype = torch.float32) -> TokenSamples:
    """The sparse target of `draws` at the loss `temperature` (its log-normaliser is
    draws.log_zp[..., temperature_index]): log p and log q of each drawn id from its centred logit, then
    `importance_weights`. The draws' `proposal_temperature` must be the one they were drawn at."""
    centred = draws.centred.double()
    log_p = centred / temperature - draws.log_zp[..., temperature_index, None].double()
    log_q = centred / proposal_temperature - draws.log_zq[..., None].double()
    used = draws.counts > 0
    # p == q exactly when the temperatures agree (the two log-normalisers differ in the last bits: ignore them).
    w = importance_weights(draws.counts, None if proposal_temperature == temperature else log_p - log_q,
                           normalize=normalize)
    return TokenSamples(draws.ids, draws.counts, w.to(dtype), torch.where(used, log_p, torch.zeros_like(log_p)).to(dtype))


@torch.no_grad()
def sample_teacher(teacher_logits, *, samples: int, proposal_temperature: float = 1.0,
                   temperature: float = 1.0, seed: int = 0, normalize: bool = True,
                   tp_group=None) -> TokenSamples:
    """Draw `samples` ids per token from softmax(teacher_logits / proposal_temperature) over the global vocabulary
    (this rank holds the contiguous shard [.., V/tp]); deterministic in `seed`, the same on every TP rank:
    `weigh(draw_teacher(...))`.

    teacher_logits: a tensor, or LogitRows (formed chunk by chunk, see draw_teacher).
    normalize=True: weights c p / q normalised to sum 1 (the paper's sparse target; exactly unbiased when the two
    temperatures are equal, O(1/samples) bias otherwise). normalize=False: weights (c / samples) p / q, the plain
    importance-sampling estimate, unbiased for any proposal (E[w] = p) at a higher variance; they need not sum to 1."""
    draws = draw_teacher(teacher_logits, samples=samples, proposal_temperature=proposal_temperature,
                         temperatures=(temperature,), seed=seed, tp_group=tp_group)
    return weigh(draws, temperature=temperature, proposal_temperature=proposal_temperature, normalize=normalize,
                 dtype=torch.float64 if teacher_logits.dtype == torch.float64 else torch.float32)  # LogitRows too


def importance_weights(counts: torch.Tensor, log_ratio: torch.Tensor | None = None, *,
                       normalize: bool = True) -> torch.Tensor:
    """Sparse-target weights from draw counts [..., S] (0 = unused slot) and log(p / q) per slot (None: p == q):
    c p / q normalised to sum 1, or (c / samples) p / q with normalize=False. Float64. For a cache that stores ids,
    counts and log-probs instead of the weights themselves."""
    c = counts.double()
    samples = c.sum(-1, keepdim=True)
    if log_ratio is None:
        return c / samples
    log_w = torch.where(counts > 0, log_ratio.double(), torch.full_like(c, -float("inf")))
    if not normalize:
        return c / samples * log_w.exp()
    w = c * (log_w - log_w.amax(-1, keepdim=True)).exp()  # shifted by the max: no overflow of p / q
    return w / w.sum(-1, keepdim=True)


class _SparseCE(torch.autograd.Function):
    """-sum_i w_i log softmax(z / T)_{id_i} (+ sum_i w_i log p_i), the student's softmax over the global vocabulary.

    Per chunk of rows the vocabulary is read into one reused scratch buffer (kdexp.losses._chunks's `load_`) and its
    log-sum-exp taken by the fused log-softmax (`lse_`): forward is one fused pass from the logits into the buffer
    (at T = 1; else a copy / T first, then in place); backward exp(z/T - lse), one scale and a scatter of the weights,
    written straight into the gradient without TP (with TP through the buffer, whose scratch column takes the ids of
    other ranks), as dense as a cross-entropy."""

    @staticmethod
    def forward(ctx, z, ids, weights, teacher_logprobs, temperature, scale, tp_group, labels=None):
        cdtype = torch.float64 if z.dtype == torch.float64 else torch.float32
        z2 = z.reshape(-1, z.shape[-1])
        n, vl = z2.shape
        shard = Shard.make(vl, tp_group, z.device)
        ids2 = ids.reshape(n, ids.shape[-1])
        check_ids(ids2, shard.vocab, "sampled id")
        w2 = weights.reshape(n, ids.shape[-1]).to(cdtype)
        lidx, owned = shard.local_index(ids2)
        gather_idx = lidx if owned is None else lidx.clamp(max=vl - 1)
        rows = sampled_rows(n, (vl + 1) * torch.finfo(cdtype).bits // 8)
        label = None if labels is None else Labels.make(labels, vl, shard, z.device)
        lm = None if labels is None else torch.zeros(n, dtype=cdtype, device=z.device)
        native = shard.world == 1 and _native.serves(z2, sampled=True)
        # Everything centred on the row max (global under TP), as the logit losses are: log s = picked - lse from
        # logits around 300 would otherwise carry an error of one ulp of 300 (3e-5), the size of a converged loss.
        if native:  # the CPU kernel: one reduction pass per row, no [rows, V] buffer
            centre, lse, picked = _native.sampled_forward(z2, gather_idx, temperature)
            if label is not None:  # -log q(label) = lse - (z[label] - centre) (T = 1)
                lm = torch.where(label.owned, lse - (z2.gather(1, label.local[:, None])[:, 0] - centre), 0.0)
        else:
            centre = torch.empty(n, dtype=cdtype, device=z.device)
            lse = torch.empty(n, dtype=cdtype, device=z.device)
            picked = torch.empty_like(w2)
            buf = torch.empty(rows, vl + 1, dtype=cdtype, device=z.device)
            raw = temperature == 1.0 and z2.dtype == cdtype  # z itself is z / T: log-softmax it straight into buf
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                c = centre[lo:hi] = shard.row_max(z2[lo:hi], cdtype)
                # z / T: the logits themselves (read, not consumed: the log-softmax goes to a contiguous [c, V] view
                # of the buffer, since given the buffer's [c, :V] slice, with its V+1 row stride, the out= kernel
                # restrides it to contiguous), else (z - centre) / T in the buffer (consumed in place; its scratch
                # column is -inf). At T = 1 the centre is left to take off (`offset`), exactly, after the gathers.
                x, offset = (z2[lo:hi], c) if raw else load_(buf[: hi - lo], z2[lo:hi], temperature, c)
                got = x.gather(1, gather_idx[lo:hi])
                picked[lo:hi] = got if offset is None else got.to(cdtype) - offset[:, None]
                into = buf.view(-1)[: (hi - lo) * vl].view(hi - lo, vl) if raw else None
                lse_g, lse_l, logp = lse_(x, shard, offset, into=into)
                lse[lo:hi] = lse_g
                if label is not None:  # -log q(label) (T = 1) from the fused log-softmax, as megatron's; owner only
                    lp = logp.gather(1, label.local[lo:hi, None])[:, 0]
                    lm[lo:hi] = torch.where(label.owned[lo:hi], -(lp + (lse_l - lse_g)), 0.0)
        if owned is not None:  # each id's student logit / T from the rank that owns it
            shard.all_reduce_(picked.masked_fill_(~owned, 0.0))
        log_s = picked - lse[:, None]
        target = teacher_logprobs.reshape(n, ids.shape[-1]).to(cdtype) if teacher_logprobs is not None else 0.0
        # 0 log 0 = 0: an unused slot (weight 0) adds nothing, whatever its log-probs (a -inf teacher entry)
        terms = w2 * (target - log_s)
        loss = torch.where(w2 == 0, 0.0, terms).sum(1) * scale
        ctx.save_for_backward(z2, lidx, w2, lse, centre)  # lidx: the caller's ids; autograd checks their version
        ctx.temperature, ctx.scale, ctx.shape, ctx.rows, ctx.label = temperature, scale, z.shape, rows, label
        ctx.world, ctx.native = shard.world, native
        if label is None:
            return loss.reshape(z.shape[:-1])
        return loss.reshape(z.shape[:-1]), shard.all_reduce_(lm).reshape(z.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out, grad_lm=None):
        z2, lidx, w2, lse, centre = ctx.saved_tensors
        n, vl = z2.shape
        label = ctx.label
        go = grad_out.reshape(n).to(w2.dtype) * (ctx.scale / ctx.temperature)
        coef = w2.sum(1) * go  # dL/d(z/T) = go * ((sum w) s - w)
        if label is not None:  # the fused LM loss (T = 1): + gl (s - onehot(label))
            gl = torch.where(label.valid, grad_lm.reshape(n).to(w2.dtype), 0.0)
            coef = coef + gl
            gl_owned = torch.where(label.owned, -gl, 0.0)
        w_go = w2 * go[:, None]  # ids not on this rank index the scratch column: no mask needed
        if ctx.native:  # the CPU kernel: softmax scaled and the weights added in one pass per row
            grad = _native.sampled_backward(z2, ctx.temperature, centre, lse, coef, lidx, w_go.neg())
            if label is not None:
                grad.scatter_add_(1, label.local[:, None], gl_owned[:, None])
            return grad.reshape(ctx.shape), None, None, None, None, None, None, None
        rows = ctx.rows
        grad = torch.empty_like(z2)
        # Straight into the gradient without TP (every id is a column of it) when it has the compute dtype; else
        # through a buffer whose last column takes the ids of other ranks.
        direct = ctx.world == 1 and grad.dtype == w2.dtype
        buf = None if direct else torch.empty(rows, vl + 1, dtype=w2.dtype, device=z2.device)
        # softmax = exp((z - centre) / T) * exp(-lse): the centred exps are <= 1 and lse >= 0 (the centre is a
        # term), so neither factor overflows, and exp(-lse) joins the per-row scale (no pass of its own)
        coef = coef * (-lse).exp()
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            c = centre[lo:hi, None]
            if direct:
                x = torch.sub(z2[lo:hi], c, out=grad[lo:hi])
                if ctx.temperature != 1.0:
                    x.div_(ctx.temperature)
            else:
                x = load_(buf[: hi - lo], z2[lo:hi], ctx.temperature, centre[lo:hi])[0]
                if ctx.temperature == 1.0:  # load_ left the raw logits (the centre was its offset)
                    x[:, :vl].sub_(c)
            x.exp_().mul_(coef[lo:hi, None])  # the student softmax, scaled
            x.scatter_add_(1, lidx[lo:hi], w_go[lo:hi].neg())
            if label is not None:
                x.scatter_add_(1, label.local[lo:hi, None], gl_owned[lo:hi, None])
            if not direct:
                grad[lo:hi].copy_(x[:, :vl])
        return grad.reshape(ctx.shape), None, None, None, None, None, None, None


def sampled_kd_loss(student_logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    teacher_logprobs: torch.Tensor | None = None, *, temperature: float = 1.0,
                    scale_by_temperature_squared: bool = False, tp_group=None, labels: torch.Tensor | None = None):
    """Per-token sampled KD loss, shape `student_logits.shape[:-1]` (float32; float64 for float64 logits).

    ids/weights [..., S]: global vocabulary ids and their (normalised) importance weights, e.g. from
    `sample_teacher` or read back from a cache; slots with weight 0 are ignored. The value is the forward-KL
    estimate sum w (log p - log s) when `teacher_logprobs` (log p at the loss temperature) is given, else the sparse
    cross-entropy -sum w log s; the gradient is the same either way. labels [...] (T = 1 only): also the per-token
    LM cross-entropy from the same log-softmax (kdexp.losses.logits_kd_loss's `labels`): returns (kd, lm).
    """
    if not all(isinstance(t, torch.Tensor) for t in (student_logits, ids, weights)) or student_logits.dim() < 1 or \
            ids.dim() < 1 or not student_logits.is_floating_point() or not weights.is_floating_point():
        raise ValueError("student_logits [..., V] and weights [..., S] must be floating-point tensors, ids [..., S] "
                         "an integer tensor")
    if ids.shape != weights.shape or ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [..., S] over the "
                         f"student's tokens {tuple(student_logits.shape[:-1])}")
    if teacher_logprobs is not None and teacher_logprobs.shape != ids.shape:
        raise ValueError(f"teacher_logprobs {tuple(teacher_logprobs.shape)} must match ids {tuple(ids.shape)}")
    if ids.shape[-1] < 1 or student_logits.shape[-1] < 1:
        raise ValueError(f"ids need at least one slot per token and the logits a vocabulary, got ids "
                         f"{tuple(ids.shape)}, logits {tuple(student_logits.shape)}")
    KDLossOptions(temperature=temperature, scale_by_temperature_squared=scale_by_temperature_squared).check()
    scale = float(temperature) ** 2 if scale_by_temperature_squared else 1.0
    if labels is not None:
        if not KDLossOptions(temperature=temperature).fuses_lm(sampled=True):
            raise ValueError(f"labels (the fused LM loss) need temperature 1.0, got {temperature}: compute the LM "
                             "loss separately")
        check_label_shape(labels, student_logits)
    return _SparseCE.apply(student_logits, ids, weights, teacher_logprobs, float(temperature), scale, tp_group, labels)


def unique_mass(samples: TokenSamples) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the teacher's mass p on the distinct drawn ids (logged as train/kept_mass) and their number
    (train/nucleus_size)."""
    used = samples.counts > 0
    mass = torch.where(used, samples.teacher_logprobs.exp(), torch.zeros_like(samples.teacher_logprobs)).sum(-1)
    return mass, used.sum(-1)
