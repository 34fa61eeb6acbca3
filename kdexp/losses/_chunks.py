"""The chunk-kernel layer under the logit KD losses (private: kdexp.losses.logits, .cached and .sampled build on it).

What every chunked logit loss needs, one rule each: the checked options of a call (`KernelConfig`, `make_cfg`) and
its fused-LM labels (`check_labels`, `Labels`), loading a chunk of raw logits into a compute-dtype buffer centred on
the row max (`load_`, `dense_chunks`), masking the kept set out of it (`mask_at_`), the fused row kernels
(`log_softmax_`, `softmax_`), the (masked) log-sum-exps across TP ranks (`lse_`, `masked_lse_`), the held-gradient
rule (`holds_gradient`) and the per-token stats and return shape (`KDStats`, `shaped`); the chunk heights are
kdexp.losses.chunking's. The names are public inside this private module: the loss modules import them from here,
never from each other.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kdexp.losses._shard import Shard
from kdexp.losses.options import KDLossOptions, cuts
from kdexp.rules import is_int



def exp_floor(dtype: torch.dtype) -> float:
    """The exponent below which the sparse losses' masked sums take exp(floor) instead of exp(x) (see masked_lse_):
    -40 in float32, -80 in float64. Each floored entry adds at most exp(floor) to a sum >= 1: 4.2e-18 (float32, eps
    6e-8) and 1.8e-35 (float64, eps 1e-16) per entry, below the sum's rounding even for 152k entries. Why not lower
    in float32: the held exps (kdexp.losses._autograd) are multiplied by the gradient's per-row factor, and
    exp(-80) = 1.8e-35 times a factor below 1e-3 (the train step's 1/tokens loss scale gives such factors) is a
    subnormal float32, whose arithmetic is as slow as the exp's own slow path."""
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
class KernelConfig:
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


def check_int(name, value):
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")


def make_cfg(vocab: int, **options) -> KernelConfig:
    """The checked options of one loss call (vocab: the global vocabulary; options: the keywords of _checked_cfg), as
    the chunk kernels read them; shared with kdexp.losses.cached so that the online and cached losses cannot drift
    apart. The losses are public functions, so every call is checked; a trainer calls them once per chunk with one
    run's options, so a checked set is remembered by value and type (a bool is not taken for an int) and the next
    call with it costs a lookup. An unhashable option (a list) is checked without the memory, which refuses it."""
    try:
        return _remembered_cfg(vocab, **options)
    except TypeError:  # unhashable: the check below names it
        return _checked_cfg(vocab, **options)


def _checked_cfg(vocab: int, *, temperature, top_k, top_p, min_k, ghost_token, normalization, divergence, beta,
                 scale_by_temperature_squared, chunk_tokens) -> KernelConfig:
    opts = KDLossOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_k=min_k, ghost_token=ghost_token,
                         normalization=normalization, divergence=divergence, beta=beta,
                         scale_by_temperature_squared=scale_by_temperature_squared).check()
    if chunk_tokens is not None:
        check_int("chunk_tokens", chunk_tokens)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
    opts.check_vocabulary(vocab)
    if not cuts(top_p):
        top_p = None  # cumsum(p) - p < 1 keeps everything in exact arithmetic; float rounding must not drop the tail
    if top_p is None:
        min_k = 1  # the floor only matters for a nucleus cut
    return KernelConfig(
        temperature=float(temperature), top_k=top_k, top_p=None if top_p is None else float(top_p), min_k=min_k,
        ghost=bool(ghost_token) and normalization == "full", renormalize=normalization == "renormalize",
        divergence=divergence, beta=float(beta),
        loss_scale=float(temperature) ** 2 if scale_by_temperature_squared else 1.0, chunk_tokens=chunk_tokens,
    )


_remembered_cfg = functools.lru_cache(maxsize=64, typed=True)(_checked_cfg)


def check_labels(labels, cfg: KernelConfig, student_logits: torch.Tensor):
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


class Labels(NamedTuple):
    """The fused LM loss's targets: each label's local column (clamped into this shard), whether this rank owns it,
    and whether it is a vocabulary id at all (a label outside [0, V) is ignored: loss 0, no gradient, as torch's
    ignore_index)."""

    local: torch.Tensor
    owned: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def make(labels: torch.Tensor, local_vocab: int, shard: Shard, device) -> "Labels":
        lab = labels.reshape(-1).to(device, torch.long)
        local = lab - shard.offset
        owned = (local >= 0) & (local < local_vocab)
        return Labels(local.clamp(0, local_vocab - 1), owned, (lab >= 0) & (lab < shard.vocab))

    def logits(self, student: torch.Tensor, shard: Shard, cd) -> torch.Tensor:
        """Each row's raw logit at its label, from the rank that owns it (0 where none does), in `cd`."""
        picked = torch.where(self.owned, student.gather(1, self.local[:, None])[:, 0].to(cd), 0.0)
        return shard.all_reduce_(picked)


def shaped(out, stats: KDStats | None, lead):
    """The public return of a loss call: the per-token loss (or the (kd, lm) pair), then the stats if asked."""
    loss = tuple(t.view(lead) for t in out) if isinstance(out, tuple) else out.view(lead)
    if stats is None:
        return loss
    return loss, KDStats(*(t.view(lead) for t in stats))


def holds_gradient(top_p, tp_world: int, logits_dtype: torch.dtype) -> bool:
    """Whether a sparse loss computes the student's exps outside S into the rows of the logit gradient (allocated in
    forward, scaled in place in backward) instead of a chunk buffer: Top-K without a nucleus cut, without TP, on
    float32 logits (the gradient then has the compute dtype and every candidate is one of its columns). kdexp.plan
    sizes the loss's buffers by this rule."""
    return top_p is None and tp_world == 1 and logits_dtype == torch.float32


def compute_dtype(student: torch.Tensor) -> torch.dtype:
    return torch.float64 if student.dtype == torch.float64 else torch.float32


def scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return x if temperature == 1.0 else x / temperature


def load_(buf: torch.Tensor, raw: torch.Tensor, temperature: float, centre: torch.Tensor | None):
    """buf[:, :V] = the chunk's logits / T in the compute dtype; an extra last column, if any, is a scratch slot at -inf.
    Returns (buf, offset): `offset` is the centre still to take off the log-sum-exps of buf (see lse_), or None.

    Why centre (on the row max): log-probs formed as x/T - logsumexp(x/T) carry an absolute error of about one ulp of
    max|x/T| (3e-5 for logits around 256 in float32), which near convergence is the size of the loss and can make it
    negative. Centred, the entries that carry the mass are O(1) and raw - centre is exact for them (Sterbenz), so the
    error is about one ulp of 1. With a division (T != 1) the centring must come first: buf = (raw - centre) / T.
    With T == 1 buf keeps the raw logits (no extra pass): log_softmax's own row max centres them exactly, and lse_
    subtracts the centre from that max, which is exact too."""
    v = raw.shape[1]
    dst = buf[:, :v]
    offset = centre
    if centre is not None and temperature != 1.0:
        if raw.dtype == buf.dtype:
            torch.sub(raw, centre[:, None], out=dst)  # one pass
        else:
            dst.copy_(raw).sub_(centre[:, None])  # a mixed-dtype (bf16 - fp32) sub has no fast CPU kernel
        dst.div_(temperature)
        offset = None
    else:
        dst.copy_(raw)
        if temperature != 1.0:
            dst.div_(temperature)
    if buf.shape[1] > v:
        buf[:, v:] = -math.inf
    return buf, offset


def dense_chunks(student: torch.Tensor, teacher: torch.Tensor, rows: int, temperature: float, cd: torch.dtype,
                  centres: torch.Tensor | None):
    """(rows slice, (teacher chunk, offset), (student chunk, offset)) from load_, in two reused compute-dtype buffers
    (forward and backward); centres: [2, n] (teacher, student) row maxima, or None."""
    n, vl = student.shape
    bt = torch.empty(rows, vl, dtype=cd, device=student.device)
    bs = torch.empty_like(bt)
    for r0 in range(0, n, rows):
        r = slice(r0, min(n, r0 + rows))
        c = r.stop - r.start
        ct, cs = (None, None) if centres is None else (centres[0, r], centres[1, r])
        yield r, load_(bt[:c], teacher[r], temperature, ct), load_(bs[:c], student[r], temperature, cs)


def mask_at_(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[r, idx[r, j]] = -inf in place (the kept set out of a chunk). From an expanded -inf tensor, not the scalar
    overload: the same writes, and the expanded source takes torch's faster CPU scatter path."""
    return x.scatter_(1, idx, x.new_full((), -math.inf).expand(idx.shape))


# Fused row kernels: one pass over the chunk instead of max/sub/exp/sum passes. On CPU they run in place (ATen's
# out= variants read each element before writing it); elsewhere they return a new chunk-sized tensor.
def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._log_softmax.out(x, 1, False, out=x)
    return torch.log_softmax(x, 1)


def softmax_(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._softmax.out(x, 1, False, out=x)
    return torch.softmax(x, 1)


def lse_(x: torch.Tensor, shard: Shard, offset: torch.Tensor | None = None, into: torch.Tensor | None = None):
    """(global log-sum-exp [c], this rank's log-sum-exp [c], this rank's log-softmax). x is consumed, or with `into`
    (a [c, V] buffer) only read: the log-softmax is written there in one fused pass. The log-sum-exps are of
    x - offset (the centre load_ left to take off; None: 0).

    -inf where every entry is masked; the log-softmax of such a row is NaN and must not be used."""
    m = x.amax(1)
    out = log_softmax_(x) if into is None else torch.ops.aten._log_softmax.out(x, 1, False, out=into)
    # out = x - m - log(sum exp(x - m)): its row max is exactly -log(sum ...), so lse = m - max(out). Two cheap
    # reductions instead of a max-with-index pass and a gather. m - offset is exact near the row max (Sterbenz), so
    # the centred lse keeps the precision of an O(1) number.
    top = m if offset is None else m - offset
    loc = torch.where(torch.isfinite(m), top - out.amax(1), torch.full_like(m, -math.inf))
    return shard.logsumexp_(loc), loc, out


def masked_lse_(x: torch.Tensor, shard: Shard, offset: torch.Tensor | None = None, m: torch.Tensor | None = None,
                 temperature: float = 1.0):
    """(global log-sum-exp [c], this rank's log-sum-exp [c], row sums [c]) of (x - offset) / T for a chunk x with
    entries masked to -inf (the kept set S out). x is left holding exp((x - m) / T) (m: x's row max, if already
    known; exponents floored at exp_floor, so masked entries hold exp(floor)), whose row sums are the third value.

    For the sparse losses, which need the log-sum-exp outside S and nothing else of the chunk: sub, floor, exp and
    sum passes where lse_'s fused log-softmax writes a log-softmax nobody reads. exp((x - m) / T) sums positive
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
    # several times the cost of a normal exp. Clamped at the floor each such entry adds exp(floor) to a sum >= 1 (the
    # max term is exp(0)): far below its rounding, so the sum is unchanged; a row with nothing outside S stays -inf
    # through `fin`.
    top = mm if offset is None else mm - offset
    s = x.clamp_min_(exp_floor(x.dtype)).exp_().sum(1)
    loc = torch.where(fin, s.log().add_(scaled(top, temperature)), torch.full_like(m, -math.inf))
    return shard.logsumexp_(loc), loc, s


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))
