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

Residual mass: the brief suggests log(-expm1(logsumexp(kept log-probs))). We compute the residual more directly: the
log-sum-exp of the logits OUTSIDE S (kept entries masked to -inf in a scratch chunk) minus the full log-sum-exp, both
sums of positive terms. That has the same value, stays accurate to relative precision when the kept mass is within
1e-7 (or 1e-30) of 1, where the expm1 form loses all digits in float32 (its input is the log of a sum that already
rounded to 1), keeps a nonzero gradient there, and is exactly -inf (a zero ghost bucket, dropped) when S is the whole
vocabulary. The full log-sum-exp is assembled from the same two parts, so one pass over the vocabulary per
distribution computes both.

Memory and speed: a custom autograd.Function computes everything chunk by chunk over tokens in float32 (float64 for
float64 inputs) and saves only the inputs plus O(K) values per token; backward recomputes the student softmax per
chunk. One exception: Top-K without a nucleus cut on float32 logits without TP computes the student's exps outside S
straight into the rows of the gradient tensor (allocated in forward instead of backward: no extra memory), which the
backward then scales in place instead of recomputing them. On CPU that path's student half (and its backward) runs in
a compiled kernel (kdexp.losses._native: the same values in one pass per row; the eager code below is its
reference and its fallback). Per chunk and distribution the full-vocabulary work is one
copy into a scratch buffer, one fused (in-place on CPU) log_softmax / softmax and two cheap max reductions; the
teacher adds one unsorted topk. The
gradient w.r.t. logits/T of the full-normalization loss is, with g = dL/d(kept student log-probs), h = dL/d(student
log-residual), G = sum g + h, q the student softmax, r the student residual:
  i in S:      g_i - q_i G
  i not in S:  exp(s_i - logsumexp_{not S} s) * (h - G r)        (the first factor is <= 1: no overflow)
Under TP each rank computes its own vocabulary slice of exactly that, with no communication in backward, so the
gradient has no factor of the TP size (as in Megatron's vocab-parallel cross-entropy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from kdexp.losses import _native
from kdexp.losses._shard import Shard
from kdexp.rules import is_int
from kdexp.losses.divergence import _xlogdot_, bucket_divergence, dense_backward_, dense_forward_
from kdexp.losses.options import KDLossOptions
# Top-P without a Top-K bound starts from this many candidates and grows x4 until the nucleus fits.
TOP_P_INITIAL_K = 1024
_MiB = 1 << 20


def _exp_floor(dtype: torch.dtype) -> float:
    """The exponent below which the sparse losses' masked sums take exp(floor) instead of exp(x) (see _masked_lse_):
    -40 in float32, -80 in float64. Each floored entry adds at most exp(floor) to a sum >= 1: 4.2e-18 (float32, eps
    6e-8) and 1.8e-35 (float64, eps 1e-16) per entry, below the sum's rounding even for 152k entries. Why not lower
    in float32: the held exps (_LogitsKD) are multiplied by the gradient's per-row factor, and exp(-80) = 1.8e-35
    times a factor below 1e-3 is a subnormal float32, whose arithmetic is as slow as the exp's own slow path
    (measured: that backward took 6.9 ms instead of 2.2 ms in a train step, at the step's 1/tokens loss scale)."""
    return -80.0 if dtype == torch.float64 else -40.0


class KDStats(NamedTuple):
    """Per-token diagnostics (shape of the loss, no gradient). kept mass = a distribution's mass in the kept set S;
    residual mass = its mass outside S (what the ghost bucket holds), computed directly, so accurate even when it is
    tiny (not as 1 - kept mass). The trainer logs student_residual_mass as train/ghost_mass."""

    teacher_kept_mass: torch.Tensor
    student_kept_mass: torch.Tensor
    nucleus_size: torch.Tensor
    teacher_residual_mass: torch.Tensor
    student_residual_mass: torch.Tensor


@dataclass(frozen=True)
class _Cfg:
    temperature: float
    top_k: int | None
    top_p: float | None
    min_k: int
    ghost: bool
    renormalize: bool
    divergence: str
    beta: float
    loss_scale: float
    chunk_tokens: int | None


def _check_int(name, value):
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")


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
    stats: dict | None = {} if return_stats else None
    out = _LogitsKD.apply(student_logits.reshape(-1, local_vocab), teacher_logits.detach().reshape(-1, local_vocab),
                          cfg, shard, stats, None, check_labels(labels, cfg, student_logits))
    return _shaped(out, stats, student_logits.shape[:-1])


def check_labels(labels, cfg: _Cfg, student_logits: torch.Tensor):
    """`labels` for the fused LM loss, checked against the loss options (None passes)."""
    if labels is None:
        return None
    if not KDLossOptions(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p).fuses_lm():
        raise ValueError(f"labels (the fused LM loss) need a Top-K / Top-P loss at temperature 1.0, got top_k="
                         f"{cfg.top_k}, top_p={cfg.top_p}, temperature={cfg.temperature}: the dense loss has no "
                         "pass of its own to share, and the LM loss is at T = 1; compute the LM loss separately")
    return check_label_shape(labels, student_logits).reshape(-1)


def check_label_shape(labels, student_logits: torch.Tensor) -> torch.Tensor:
    """`labels` as the fused LM loss takes them: an integer tensor of the logits' leading shape."""
    if not isinstance(labels, torch.Tensor) or labels.shape != student_logits.shape[:-1] or labels.is_floating_point():
        raise ValueError(f"labels must be an integer tensor of the logits' leading shape "
                         f"{tuple(student_logits.shape[:-1])}, got {getattr(labels, 'shape', labels)!r}")
    return labels


def _shaped(out, stats: dict | None, lead):
    """The public return of a loss call: the per-token loss (or the (kd, lm) pair), then the stats if asked."""
    loss = tuple(t.view(lead) for t in out) if isinstance(out, tuple) else out.view(lead)
    if stats is None:
        return loss
    return loss, KDStats(*(stats[name].view(lead) for name in KDStats._fields))


def make_cfg(vocab: int, *, temperature, top_k, top_p, min_k, ghost_token, normalization, divergence, beta,
             scale_by_temperature_squared, chunk_tokens) -> _Cfg:
    """The checked options of one loss call (vocab: the global vocabulary), as the chunk kernels read them; shared
    with kdexp.losses.cached so that the online and cached losses cannot drift apart."""
    opts = KDLossOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_k=min_k, ghost_token=ghost_token,
                         normalization=normalization, divergence=divergence, beta=beta,
                         scale_by_temperature_squared=scale_by_temperature_squared).check()
    if chunk_tokens is not None:
        _check_int("chunk_tokens", chunk_tokens)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
    opts.check_vocabulary(vocab)
    if top_p is not None and float(top_p) == 1.0:
        top_p = None  # cumsum(p) - p < 1 keeps everything in exact arithmetic; float rounding must not drop the tail
    if top_p is None:
        min_k = 1  # the floor only matters for a nucleus cut
    return _Cfg(
        temperature=float(temperature), top_k=top_k, top_p=None if top_p is None else float(top_p), min_k=min_k,
        ghost=bool(ghost_token) and normalization == "full", renormalize=normalization == "renormalize",
        divergence=divergence, beta=float(beta),
        loss_scale=float(temperature) ** 2 if scale_by_temperature_squared else 1.0, chunk_tokens=chunk_tokens,
    )


def holds_gradient(top_p, tp_world: int, logits_dtype: torch.dtype) -> bool:
    """Whether a sparse loss computes the student's exps outside S into the rows of the logit gradient (allocated in
    forward, scaled in place in backward) instead of a chunk buffer: Top-K without a nucleus cut, without TP, on
    float32 logits (the gradient then has the compute dtype and every candidate is one of its columns). kdexp.plan
    sizes the loss's buffers by this rule."""
    return top_p is None and tp_world == 1 and logits_dtype == torch.float32


def _compute_dtype(student: torch.Tensor) -> torch.dtype:
    return torch.float64 if student.dtype == torch.float64 else torch.float32


def _chunk_rows(n: int, shard: Shard, cdtype: torch.dtype, chunk_tokens: int | None) -> int:
    if n == 0:  # no tokens: no chunk (the loss is an empty per-token tensor, its gradient empty)
        return 1
    if chunk_tokens is not None:
        return max(1, min(n, chunk_tokens))
    row = (shard.max_local_vocab + 1) * torch.finfo(cdtype).bits // 8
    budget = min(64 * _MiB, max(4 * _MiB, n * row // 16))
    rows = max(1, min(n, budget // row))
    return -(-n // -(-n // rows))  # as many chunks, of equal height: no sliver of a last chunk (2 of 1,024 rows)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return x if temperature == 1.0 else x / temperature


def _load_(buf: torch.Tensor, raw: torch.Tensor, temperature: float, centre: torch.Tensor | None):
    """buf[:, :V] = the chunk's logits / T in the compute dtype; an extra last column, if any, is a scratch slot at -inf.
    Returns (buf, offset): `offset` is the centre still to take off the log-sum-exps of buf (see _lse_), or None.

    Why centre (on the row max): log-probs formed as x/T - logsumexp(x/T) carry an absolute error of about one ulp of
    max|x/T| (3e-5 for logits around 256 in float32), which near convergence is the size of the loss and can make it
    negative. Centred, the entries that carry the mass are O(1) and raw - centre is exact for them (Sterbenz), so the
    error is about one ulp of 1. With a division (T != 1) the centring must come first: buf = (raw - centre) / T.
    With T == 1 buf keeps the raw logits (no extra pass): log_softmax's own row max centres them exactly, and _lse_
    subtracts the centre from that max, which is exact too."""
    v = raw.shape[1]
    dst = buf[:, :v]
    offset = centre
    if centre is not None and temperature != 1.0:
        if raw.dtype == buf.dtype:
            torch.sub(raw, centre[:, None], out=dst)  # one pass
        else:
            dst.copy_(raw).sub_(centre[:, None])  # a mixed-dtype (bf16 - fp32) sub is ~10x slower on CPU
        dst.div_(temperature)
        offset = None
    else:
        dst.copy_(raw)
        if temperature != 1.0:
            dst.div_(temperature)
    if buf.shape[1] > v:
        buf[:, v:] = -math.inf
    return buf, offset


def _dense_chunks(student: torch.Tensor, teacher: torch.Tensor, rows: int, temperature: float, cd: torch.dtype,
                  centres: torch.Tensor | None):
    """(rows slice, (teacher chunk, offset), (student chunk, offset)) from _load_, in two reused compute-dtype buffers
    (forward and backward); centres: [2, n] (teacher, student) row maxima, or None."""
    n, vl = student.shape
    bt = torch.empty(rows, vl, dtype=cd, device=student.device)
    bs = torch.empty_like(bt)
    for r0 in range(0, n, rows):
        r = slice(r0, min(n, r0 + rows))
        c = r.stop - r.start
        ct, cs = (None, None) if centres is None else (centres[0, r], centres[1, r])
        yield r, _load_(bt[:c], teacher[r], temperature, ct), _load_(bs[:c], student[r], temperature, cs)


def _mask_at_(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[r, idx[r, j]] = -inf in place (the kept set out of a chunk). From an expanded -inf tensor, not the scalar
    overload: the same writes, ~3x faster on CPU (1M entries: 0.54 ms against 1.64 ms)."""
    return x.scatter_(1, idx, x.new_full((), -math.inf).expand(idx.shape))


# Fused row kernels: one pass over the chunk instead of max/sub/exp/sum passes. On CPU they run in place (ATen's
# out= variants read each element before writing it); elsewhere they return a new chunk-sized tensor.
def _log_softmax_(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._log_softmax.out(x, 1, False, out=x)
    return torch.log_softmax(x, 1)


def _softmax_(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._softmax.out(x, 1, False, out=x)
    return torch.softmax(x, 1)


def _lse_(x: torch.Tensor, shard: Shard, offset: torch.Tensor | None = None, into: torch.Tensor | None = None):
    """(global log-sum-exp [c], this rank's log-sum-exp [c], this rank's log-softmax). x is consumed, or with `into`
    (a [c, V] buffer) only read: the log-softmax is written there in one fused pass. The log-sum-exps are of
    x - offset (the centre _load_ left to take off; None: 0).

    -inf where every entry is masked; the log-softmax of such a row is NaN and must not be used."""
    m = x.amax(1)
    out = _log_softmax_(x) if into is None else torch.ops.aten._log_softmax.out(x, 1, False, out=into)
    # out = x - m - log(sum exp(x - m)): its row max is exactly -log(sum ...), so lse = m - max(out). Two cheap
    # reductions instead of a max-with-index pass and a gather. m - offset is exact near the row max (Sterbenz), so
    # the centred lse keeps the precision of an O(1) number.
    top = m if offset is None else m - offset
    loc = torch.where(torch.isfinite(m), top - out.amax(1), torch.full_like(m, -math.inf))
    return shard.logsumexp_(loc), loc, out


def _masked_lse_(x: torch.Tensor, shard: Shard, offset: torch.Tensor | None = None, m: torch.Tensor | None = None,
                 temperature: float = 1.0):
    """(global log-sum-exp [c], this rank's log-sum-exp [c], row sums [c]) of (x - offset) / T for a chunk x with
    entries masked to -inf (the kept set S out). x is left holding exp((x - m) / T) (m: x's row max, if already
    known; exponents floored at _exp_floor, so masked entries hold exp(floor)), whose row sums are the third value.

    For the sparse losses, which need the log-sum-exp outside S and nothing else of the chunk: sub, floor, exp and
    sum passes where _lse_'s fused log-softmax writes a log-softmax nobody reads. exp((x - m) / T) sums positive
    terms <= 1 with the largest exactly 1; (m - offset) / T is exact near the row max (Sterbenz), so the centred
    result keeps the precision of an O(1) number. -inf where every entry is masked."""
    if m is None:
        m = x.amax(1)
    fin = torch.isfinite(m)
    mm = torch.where(fin, m, torch.zeros_like(m))
    x.sub_(mm[:, None])
    if temperature != 1.0:
        x.div_(temperature)
    # exp of -inf (the mask) or of anything below ~-87 (a zero or subnormal result) takes a slow path on x86 CPUs,
    # 2.5x-20x the time of a normal exp. Clamped at the floor each such entry adds exp(floor) to a sum >= 1 (the
    # max term is exp(0)): far below its rounding, so the sum is unchanged; a row with nothing outside S stays -inf
    # through `fin`.
    top = mm if offset is None else mm - offset
    s = x.clamp_min_(_exp_floor(x.dtype)).exp_().sum(1)
    loc = torch.where(fin, s.log().add_(_scaled(top, temperature)), torch.full_like(m, -math.inf))
    return shard.logsumexp_(loc), loc, s


class _LogitsKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, cfg: _Cfg, shard: Shard, stats, teacher_side=None, labels=None):
        # teacher_side(rows) -> (gidx, keep, a, lr_t): the teacher half of a sparse chunk from elsewhere (a cache);
        # `teacher` is then unused. labels [n] (sparse, T = 1): the LM cross-entropy too, returned second.
        n, vl = student.shape
        dev = student.device
        cd = _compute_dtype(student)
        rows = _chunk_rows(n, shard, cd, cfg.chunk_tokens)
        dense = cfg.top_k is None and cfg.top_p is None
        loss = torch.empty(n, dtype=cd, device=dev)
        st = {f: torch.empty(n, dtype=cd, device=dev) for f in KDStats._fields} if stats is not None else None
        ctx.cfg, ctx.shard, ctx.rows, ctx.dense, ctx.cd = cfg, shard, rows, dense, cd
        if dense:
            # log_softmax centres each row itself, exactly when nothing was divided before it; a division by T or the
            # local-to-global log-sum-exp shift under TP (a difference of two values ~max|x|) needs the centring.
            centres = None
            if cfg.temperature != 1.0 or shard.world > 1:
                centres = torch.stack([shard.row_max(teacher, cd), shard.row_max(student, cd)])
            shift = torch.zeros(2, n, dtype=cd, device=dev)  # local minus global log-sum-exp (0 without TP)
            aux = torch.empty(n, dtype=cd, device=dev)
            for r, (xt, ot), (xs, os_) in _dense_chunks(student, teacher, rows, cfg.temperature, cd, centres):
                if shard.world == 1:
                    a, b = _log_softmax_(xt), _log_softmax_(xs)
                else:
                    lse_t, loc_t, a = _lse_(xt, shard, ot)
                    lse_s, loc_s, b = _lse_(xs, shard, os_)
                    shift[0, r], shift[1, r] = loc_t - lse_t, loc_s - lse_s
                    a.add_(shift[0, r, None])
                    b.add_(shift[1, r, None])
                part = shard.all_reduce_(dense_forward_(a, b, cfg.divergence, cfg.beta))
                loss[r], aux[r] = part[:, 0], part[:, 1]
            ctx.save_for_backward(student, teacher)
            ctx.label, ctx.held = None, None
            ctx.shift, ctx.aux, ctx.raw_loss, ctx.centres = shift, aux, loss.clone(), centres
            if st is not None:
                st["teacher_kept_mass"].fill_(1.0)
                st["student_kept_mass"].fill_(1.0)
                st["nucleus_size"].fill_(shard.vocab)
                st["teacher_residual_mass"].zero_()
                st["student_residual_mass"].zero_()
        else:
            # Top-K without a nucleus cut, no TP, float32: the gradient is allocated here and each chunk computes its
            # student exps outside S in its own rows (every candidate is a column: no scratch column needed). The
            # backward then scales them in place (one pass) instead of recomputing them (four). The buffer is the
            # gradient the backward returns anyway, so it moves that allocation forward rather than adding one, and
            # the chunk buffer is not needed at all.
            held = (torch.empty(n, vl, dtype=cd, device=dev)
                    if ctx.needs_input_grad[0] and holds_gradient(cfg.top_p, shard.world, student.dtype) else None)
            if held is not None and teacher_side is not None and cfg.chunk_tokens is None and \
                    _native.serves(student, held):
                # From a cache on the CPU kernel: no [rows, V] eager pass is left to keep in cache, so one chunk of
                # up to 64 MiB of K-wide values runs the per-row glue once instead of once per chunk
                rows = ctx.rows = max(1, min(n, max(rows, _native.CHUNK_BYTES // (16 * (cfg.top_k + 1)))))
            buf = torch.empty(rows, vl + 1, dtype=cd, device=dev) if held is None else None
            chunks = []
            label = None if labels is None else _Labels.make(labels, vl, shard, dev)
            label_logit = None if label is None else label.logits(student, shard, cd)
            lm = None if labels is None else torch.empty(n, dtype=cd, device=dev)
            for r0 in range(0, n, rows):
                r = slice(r0, min(n, r0 + rows))
                b = buf[: r.stop - r.start] if held is None else held[r]
                side = (_teacher_side(teacher[r], b, cfg, shard, cd, st is not None) if teacher_side is None
                        else teacher_side(r, cd))
                out = _student_side(student[r], b, cfg, shard, cd, st is not None, *side, lm=labels is not None,
                                    held=held is not None)
                loss[r] = out["loss"]
                if label is not None:  # -log q(label) = lse - (x_label - centre): both centred, as megatron's
                    lm[r] = torch.where(label.valid[r], out["lse"] - (label_logit[r] - out["centre"]), 0.0)
                chunks.append((r, out["gidx"], out["keep"], out["cand_grad"], out["coef"], out["centre"],
                               out.get("q"), out["exp_sum"]))
                if st is not None:
                    for f in KDStats._fields:
                        st[f][r] = out[f]
            ctx.held = held
            # The kept ids go through save_for_backward: a cached record's ids are the caller's tensor, and autograd's
            # version check refuses a backward after they changed in place (the CPU kernel checks them again)
            ctx.save_for_backward(student, *(c[1] for c in chunks))
            ctx.chunks, ctx.label = [c[:1] + c[2:] for c in chunks], label
        if st is not None:
            stats.update({f: (v.long() if f == "nucleus_size" else v) for f, v in st.items()})
        if dense or cfg.ghost or cfg.renormalize or cfg.divergence == "jsd":
            # Between two proper distributions every divergence here is >= 0, and the JSD is >= 0 bucket by bucket
            # (log-sum inequality), so over any kept set; float32 rounding of the log-probs (~1e-7 absolute) can land
            # a near-converged value just below. Clamping the value moves it towards the exact one; the gradient
            # (computed in backward from the unclamped terms) is unchanged. Without the ghost bucket the kept
            # sub-distributions of a KL can give a negative value in exact arithmetic: left as it is.
            loss.clamp_min_(0.0)
        if cfg.loss_scale != 1.0:
            loss.mul_(cfg.loss_scale)
        if not dense and labels is not None:
            return (loss, lm) if cd == torch.float64 else (loss.float(), lm.float())
        return loss if cd == torch.float64 else loss.float()

    @staticmethod
    def backward(ctx, grad_out, grad_lm=None):
        cfg, shard, rows, cd = ctx.cfg, ctx.shard, ctx.rows, ctx.cd
        student = ctx.saved_tensors[0]
        n, vl = student.shape
        dev = student.device
        held, ctx.held = ctx.held, None  # the forward's exps are scaled in place once: a second backward
        # (retain_graph) recomputes them
        grad = held if held is not None else torch.empty(n, vl, dtype=student.dtype, device=dev)
        scale = grad_out.reshape(-1).to(cd) * (cfg.loss_scale / cfg.temperature)
        if ctx.dense:
            teacher = ctx.saved_tensors[1]
            for r, (xt, _), (xs, _) in _dense_chunks(student, teacher, rows, cfg.temperature, cd, ctx.centres):
                if cfg.divergence == "forward_kl":  # q - p straight from the fused softmax
                    p, q = _softmax_(xt), _softmax_(xs)
                    if shard.world > 1:
                        p.mul_(ctx.shift[0, r, None].exp())
                        q.mul_(ctx.shift[1, r, None].exp())
                    g = q.sub_(p)
                else:
                    a, b = _log_softmax_(xt), _log_softmax_(xs)
                    if shard.world > 1:
                        a.add_(ctx.shift[0, r, None])
                        b.add_(ctx.shift[1, r, None])
                    g = dense_backward_(a, b, ctx.raw_loss[r], ctx.aux[r], cfg.divergence, cfg.beta)
                torch.mul(g, scale[r, None], out=grad[r])
            return grad, None, None, None, None, None, None
        buf = None
        label = ctx.label
        # The fused LM loss adds q - onehot(label) (T = 1): outside S q = exp(s - centre - lse_notS) r_s, the KD
        # term's own factor times the student residual; on S the kept probabilities q saved by the forward.
        gl = None if label is None else torch.where(label.valid, grad_lm.reshape(-1).to(cd), 0.0)
        for gidx, (r, keep, cand_grad, coef, centre, q, exp_sum) in zip(ctx.saved_tensors[1:], ctx.chunks):
            c = r.stop - r.start
            lidx, owned = shard.local_index(gidx, keep)
            # Straight into the gradient when every candidate is a column of it (no TP, no nucleus cut) and it has
            # the compute dtype; else through a buffer whose last column takes the candidates not owned / not kept.
            direct = owned is None and grad.dtype == cd
            if not direct and buf is None:
                buf = torch.empty(rows, vl + 1, dtype=cd, device=dev)
            x = grad[r] if direct else buf[:c]
            sc = scale[r, None]
            native = False  # the CPU kernel scales the held rows and writes S (forward KL, every candidate kept)
            if coef is None:  # renormalize: the loss depends on the kept logits only
                x.zero_()
            else:  # exp((s - centre) / T - lse_notS) * (h - G r_s) everywhere; S is overwritten just below
                cf, lns, r_s = coef
                cf = cf * sc[:, 0] if gl is None else torch.addcmul(gl[r] * r_s, cf, sc[:, 0])
                if held is not None and exp_sum is not None:
                    # the rows hold e = exp((s - m) / T) outside S, and exp((s - centre) / T - lse_notS) = e / sum(e)
                    f_out = cf.div_(exp_sum)
                    native = isinstance(cand_grad, _SplitGrad) and _native.serves(student, held)
                    if not native:
                        x.mul_(f_out[:, None])
                else:
                    dst, raw = x[:, :vl], student[r]
                    if raw.dtype == cd:
                        torch.sub(raw, centre[:, None], out=dst)
                    else:
                        dst.copy_(raw).sub_(centre[:, None])
                    if cfg.temperature != 1.0:
                        dst.div_(cfg.temperature)
                    dst.sub_(lns[:, None]).exp_().mul_(cf[:, None])
            if isinstance(cand_grad, _SplitGrad):  # e (w sc + gl / total) - p sc: two passes over S
                f = cand_grad.w * sc[:, 0]
                if gl is not None:
                    f.addcmul_(gl[r], cand_grad.inv_total)
                if native:
                    _native.topk_backward_(x, lidx, cand_grad.e, cand_grad.p, f_out, f, sc)
                else:
                    g_s = torch.mul(cand_grad.p, sc.neg()).addcmul_(cand_grad.e, f[:, None])
            else:
                g_s = cand_grad * sc if gl is None else torch.addcmul(cand_grad * sc, q, gl[r, None])
            if not native:
                x.scatter_(1, lidx, g_s)  # entries not owned / not kept land in the scratch column
            if gl is not None:  # - onehot(label), on the rank that owns it
                x.scatter_add_(1, label.local[r, None], torch.where(label.owned[r], -gl[r], 0.0)[:, None])
            if not direct:
                grad[r].copy_(x[:, :vl])
        return grad, None, None, None, None, None, None


class _SplitGrad(NamedTuple):
    """Forward KL with every candidate kept: dL/d(student logits / T) on S is e w - p, kept as its parts so that the
    backward forms the scaled gradient (plus the fused LM term q gl, q = e / total) in two passes over S instead of
    the forward's two plus the backward's three. e: the student's exps over S (centred, not normalised), w: -G /
    total per row, p: the teacher's kept probabilities, inv_total: 1 / total."""

    e: torch.Tensor
    w: torch.Tensor
    p: torch.Tensor
    inv_total: torch.Tensor


class _Labels(NamedTuple):
    """The fused LM loss's targets: each label's local column (clamped into this shard), whether this rank owns it,
    and whether it is a vocabulary id at all (a label outside [0, V) is ignored: loss 0, no gradient, as torch's
    ignore_index)."""

    local: torch.Tensor
    owned: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def make(labels: torch.Tensor, local_vocab: int, shard: Shard, device) -> "_Labels":
        lab = labels.reshape(-1).to(device, torch.long)
        local = lab - shard.offset
        owned = (local >= 0) & (local < local_vocab)
        return _Labels(local.clamp(0, local_vocab - 1), owned, (lab >= 0) & (lab < shard.vocab))

    def logits(self, student: torch.Tensor, shard: Shard, cd) -> torch.Tensor:
        """Each row's raw logit at its label, from the rank that owns it (0 where none does), in `cd`."""
        picked = torch.where(self.owned, student.gather(1, self.local[:, None])[:, 0].to(cd), 0.0)
        return shard.all_reduce_(picked)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _teacher_side(teacher, buf, cfg: _Cfg, shard: Shard, cd, want_stats: bool):
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
        vals = _scaled(vals - m_t[:, None], cfg.temperature)
        keep = None
        if not need_t:
            a = vals  # unnormalised: only differences within S matter below
            break
        lidx, _ = shard.local_index(gidx)
        xt, offset = _load_(buf, teacher, cfg.temperature, m_t)
        lc_t = _masked_lse_(_mask_at_(xt, lidx), shard, offset)[0]
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


def _student_side(student, buf, cfg: _Cfg, shard: Shard, cd, want_stats: bool, gidx, keep, a, lr_t, lm=False,
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
        xs = _mask_at_(_load_(buf, student, 1.0, None)[0], lidx)
        m_loc = xs.amax(1)
        m_s = torch.maximum(shard.all_reduce_(m_loc.clone(), op=dist.ReduceOp.MAX) if shard.world > 1 else m_loc,
                            sv.amax(1))
        m_s = _finite_or_zero(m_s)
        lns, _, exp_sum = _masked_lse_(xs, shard, m_s, m_loc, cfg.temperature)
        # One exp over S gives the log-sum-exp, the log-probs and the probabilities. The total is >= 1 (the row max
        # is a term, inside S or in exp(lns)), so the floor's exp(floor) per entry (not kept: -inf) is below its
        # rounding, as in _masked_lse_.
        sv = _scaled(sv.sub_(m_s[:, None]), cfg.temperature)  # in place: sv is this function's own gathered copy
        e = (sv.exp() if keep is None else sv.clamp_min(_exp_floor(sv.dtype)).exp_())
        total = e.sum(1).add_(lns.exp())
        lse_s = total.log()
        b = sv.sub_(lse_s[:, None])
        inv_total = total.reciprocal()  # q = exp(b) = e / total; its entries not kept land in the scratch column
        lr_s = lns - lse_s
    elif not need_s:  # renormalised without stats: only differences within S matter, the max over S centres them
        m_s = sv.amax(1)
        b = _scaled(sv - m_s[:, None], cfg.temperature)

    q = e.mul_(inv_total[:, None]) if need_s and not fkl else None  # forward KL keeps e and 1 / total (below)
    if cfg.renormalize:
        a_r = a_kept - torch.logsumexp(a_kept, 1, keepdim=True)
        b_r = b - torch.logsumexp(b, 1, keepdim=True)
        loss, g = bucket_divergence(a_r, b_r, keep, cfg.divergence, cfg.beta)
        cand_grad = g - b_r.exp() * g.sum(1, keepdim=True)
        coef = None
        if lm:  # the KD term has nothing outside S; the LM term has
            coef = (torch.zeros_like(lns), _finite_or_zero(lns), lr_s.exp())
    else:
        # Forward KL with every candidate kept: g = -p on S, whose sum is minus the teacher's kept mass, 1 - r_t
        # (from its residual's log: no pass over the buckets, and no -p); the loss is sum p (a - b).
        if fkl and native:
            loss = kl
        elif fkl:
            p = a.exp()
            loss = _xlogdot_(a.sub_(b), p)  # a is the teacher side's own copy, not read after this
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
            cand_grad = _SplitGrad(e, gsum.neg().mul_(inv_total), p, inv_total)
        else:
            gsum = g.sum(1) + h
            cand_grad = g - q * gsum[:, None]
        # Outside S: dL/ds_i = exp(s_i - lse_notS) (h - G r_s); backward recomputes the first factor from the
        # centre and lse_notS (0 where nothing is outside S: no entry reads it).
        r_s = lr_s.exp()
        coef = (torch.where(torch.isfinite(lns), h - gsum * r_s, torch.zeros_like(lns)), _finite_or_zero(lns), r_s)
    # exp_sum: the row sums of the exps _masked_lse_ left in `buf` (none when renormalised without stats)
    out = {"loss": loss, "gidx": gidx, "keep": keep, "cand_grad": cand_grad, "coef": coef, "centre": m_s,
           "exp_sum": exp_sum if need_s else None}
    if lm:
        out.update(lse=lse_s, q=q)
    if want_stats:
        # kept mass = 1 - residual mass, from the residuals' accurate logs (no pass over the buckets)
        out.update(teacher_kept_mass=-torch.expm1(lr_t), student_kept_mass=-torch.expm1(lr_s),
                   nucleus_size=(torch.full_like(lr_s, a.shape[1]) if keep is None else keep.sum(1).to(cd)),
                   teacher_residual_mass=lr_t.exp(),
                   student_residual_mass=lr_s.exp())
    return out
