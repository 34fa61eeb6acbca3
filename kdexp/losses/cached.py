"""The logit KD loss against a cached teacher: what to store per token, and the loss computed from it.

`teacher_topk_record(teacher_logits, k_max, temperatures)` is the teacher side of an offline cache (one pass, no
grad): per token the teacher's global top-`k_max` logits CENTRED on the row max (so entry 0 is exactly 0; centring
is what the online loss does first too, and it keeps a bf16/fp16 copy precise where the mass is), sorted descending,
their global indices, and per temperature T two log-sum-exps of the centred logits / T: over the whole vocabulary
(`lse`) and over the complement of the top-k_max set (`lse_rest`), each a sum of positive terms.

`cached_kd_loss(student_logits, values, indices, lse, lse_rest, ...)` is `logits_kd_loss` with the teacher half of
each chunk read from such a record instead of computed from full teacher logits. The student half (gather, student
log-sum-exps, the bucket divergence, the backward, TP) is the online loss's own code (kdexp.losses._sparse and
._autograd), called as it is, so for any top_k <= k_max, top_p / min_k, ghost on/off, divergence and a cached
temperature the loss and gradient are the online ones up to float rounding. The teacher residual outside the kept
set S (top_k prefix, then the nucleus cut) is
    logsumexp(lse_rest, kept-set candidates cut by the nucleus, entries k..k_max) - lse
a sum of positive terms: accurate when the kept mass is within 1e-7 of 1, where 1 - sum(exp(kept)) (Megatron-LM's
cached_logits_loss) has lost every digit. A true nucleus (top_p without top_k) is served when every token's nucleus
lies within its cached top-k_max: the stored lse_rest gives the cached mass, which must reach top_p; the cut is then
the online one over the same sorted entries (ties by id in both). Otherwise, and for dense KD: ValueError (naming
how many tokens overflow and a lower bound on the k_max that would serve them).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from kdexp.losses._autograd import LogitsKD
from kdexp.losses._chunks import (check_labels, compute_dtype, load_, make_cfg, mask_at_, masked_lse_, scaled,
                                  shaped)
from kdexp.losses._shard import Shard, check_ids
from kdexp.losses.chunking import logit_rows
from kdexp.losses.options import cuts
from kdexp.rules import is_real

__all__ = ["TeacherRecord", "teacher_topk_record", "cached_kd_loss"]


class TeacherRecord(NamedTuple):
    """Per token ([...] = the logits' leading shape): values [..., K] centred teacher logits (entry 0 is 0), sorted
    descending; indices [..., K] global vocabulary ids (long); lse, lse_rest [..., n_temperatures] (float32/64)."""

    values: torch.Tensor
    indices: torch.Tensor
    lse: torch.Tensor
    lse_rest: torch.Tensor


@torch.no_grad()
def teacher_topk_record(teacher_logits: torch.Tensor, k_max: int, temperatures: Sequence[float], *, tp_group=None,
                        chunk_tokens: int | None = None) -> TeacherRecord:
    """What the cache stores for `teacher_logits` [..., V_local] (this TP rank's vocabulary shard; the record is the
    same on every rank of `tp_group`). Float32 (float64 for float64 logits)."""
    if not isinstance(teacher_logits, torch.Tensor) or teacher_logits.dim() < 1 or \
            not teacher_logits.is_floating_point():
        raise ValueError("teacher_logits must be a floating-point tensor with a vocabulary dimension")
    temps = [float(t) for t in temperatures]
    if not temps or any(not math.isfinite(t) or t <= 0 for t in temps):
        raise ValueError(f"temperatures must be a non-empty list of finite numbers > 0, got {list(temperatures)}")
    vl = teacher_logits.shape[-1]
    shard = Shard.make(vl, tp_group, teacher_logits.device)
    if isinstance(k_max, bool) or not isinstance(k_max, int) or not 1 <= k_max <= shard.vocab:
        raise ValueError(f"k_max={k_max!r} is invalid: must be an integer in [1, the vocabulary size {shard.vocab}]")
    lead = teacher_logits.shape[:-1]
    raw = teacher_logits.reshape(-1, vl)
    n = raw.shape[0]
    cd = compute_dtype(raw)
    rows = logit_rows(n, shard.max_local_vocab, cd, chunk_tokens)
    values = torch.empty(n, k_max, dtype=cd, device=raw.device)
    indices = torch.empty(n, k_max, dtype=torch.long, device=raw.device)
    lse = torch.empty(n, len(temps), dtype=cd, device=raw.device)
    rest = torch.empty_like(lse)
    buf = torch.empty(rows, vl + 1, dtype=cd, device=raw.device)
    for r0 in range(0, n, rows):
        r = slice(r0, min(n, r0 + rows))
        x = raw[r]
        vals, gidx = shard.global_topk(x, k_max, cd, sort=True)
        m = vals[:, 0].clone()  # the global row max: the top-1
        centred = vals - m[:, None]  # the same subtraction the online loss does (exact near the max: Sterbenz)
        values[r], indices[r] = centred, gidx
        lidx, _ = shard.local_index(gidx)
        for j, t in enumerate(temps):
            xt, offset = load_(buf[: r.stop - r.start], x, t, m)
            lc = masked_lse_(mask_at_(xt, lidx), shard, offset)[0]  # outside the top-k_max
            rest[r, j] = lc
            lse[r, j] = torch.logsumexp(torch.cat([lc[:, None], scaled(centred, t)], 1), 1)
    return TeacherRecord(values.view(*lead, k_max), indices.view(*lead, k_max), lse.view(*lead, len(temps)),
                         rest.view(*lead, len(temps)))


def cached_kd_loss(
    student_logits: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    lse_rest: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_k: int = 1,
    ghost_token: bool = True,
    normalization: str = "full",
    divergence: str = "forward_kl",
    beta: float = 0.5,
    scale_by_temperature_squared: bool = False,
    tp_group=None,
    return_stats: bool = False,
    chunk_tokens: int | None = None,
    labels: torch.Tensor | None = None,
):
    """`logits_kd_loss` (same keywords, same result, `labels` included) with the teacher given by a cached record at `temperature`:
    values/indices [..., K_max] as `teacher_topk_record` gives them (any float dtype for values: a compact cache's
    bf16/fp16 is widened here), lse/lse_rest [...] the record's log-sum-exps AT THIS temperature. top_k <= K_max, or
    top_k=None with a nucleus (top_p < 1) that fits in every token's cached top-K_max (else ValueError)."""
    if not isinstance(student_logits, torch.Tensor) or student_logits.dim() < 1:
        raise ValueError("student_logits must be a tensor with a vocabulary dimension")
    lead = student_logits.shape[:-1]
    k_max = values.shape[-1]
    for name, t, shape in (("values", values, (*lead, k_max)), ("indices", indices, (*lead, k_max)),
                           ("lse", lse, lead), ("lse_rest", lse_rest, lead)):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (student_logits "
                             f"{tuple(student_logits.shape)}, K_max {k_max})")
    if top_k is None and (top_p is None or is_real(top_p)) and not cuts(top_p):
        raise ValueError("top_k=None without a nucleus cut (top_p < 1) is invalid with a cached teacher: the cache "
                         f"holds only the teacher's top-{k_max}, so dense KD cannot be served; set top_k in "
                         f"[1, {k_max}] or top_p")
    if top_k is None and isinstance(min_k, int) and min_k > k_max:
        raise ValueError(f"min_k={min_k} is invalid: must be in [1, the cached K_max={k_max}]")
    if not isinstance(top_k, bool) and isinstance(top_k, int) and top_k > k_max:
        raise ValueError(f"top_k={top_k} is invalid: must be in [1, the cached K_max={k_max}]")
    local_vocab = student_logits.shape[-1]
    shard = Shard.make(local_vocab, tp_group, student_logits.device)
    cfg = make_cfg(shard.vocab, temperature=temperature, top_k=top_k, top_p=top_p, min_k=min_k,
                   ghost_token=ghost_token, normalization=normalization, divergence=divergence, beta=beta,
                   scale_by_temperature_squared=scale_by_temperature_squared, chunk_tokens=chunk_tokens)
    v = values.reshape(-1, k_max)
    check_ids(indices.reshape(-1, k_max), shard.vocab, "cached teacher id")
    ix = indices.reshape(-1, k_max).long()
    lz = lse.reshape(-1)
    lr = lse_rest.reshape(-1)
    nucleus = cfg.top_k is None  # a true nucleus (top_p set, no top_k): served from the K_max entries if it fits
    k = k_max if nucleus else top_k
    if nucleus:
        check_nucleus_fits(v, lz, lr, cfg.top_p, cfg.temperature, shard.vocab)

    def teacher_side(r: slice, cd: torch.dtype):
        vals = scaled(v[r].to(cd), cfg.temperature)  # already centred on the top-1
        kept_vals, tail = vals[:, :k], vals[:, k:]
        z = lz[r].to(cd)
        a = kept_vals - z[:, None]
        # log-sum-exps of what is not kept: beyond K_max, entries k..K_max (none when top_k = K_max)
        outside = [lr[r].to(cd)[:, None]] + ([tail] if tail.shape[1] else [])
        keep = None  # every candidate kept (no nucleus cut)
        if cfg.top_p is not None:  # the online cut: float64 cumsum over the sorted candidates, min-K floor
            p = a.double().exp()
            cum = p.cumsum(1)
            keep = (cum - p < cfg.top_p) | (torch.arange(k, device=a.device) < cfg.min_k)
            outside.append(torch.where(keep, torch.full_like(kept_vals, -math.inf), kept_vals))
        # one column (top_k = K_max, no cut): the log-sum-exp is that column (no cat, no reduction)
        lr_t = (outside[0][:, 0] if len(outside) == 1 else torch.logsumexp(torch.cat(outside, 1), 1)) - z
        if nucleus and keep.shape[0]:  # keep is a prefix: drop the columns no token keeps (as the online nucleus)
            kk = int(keep.sum(1).max())
            return ix[r, :kk], keep[:, :kk], a[:, :kk], lr_t
        return ix[r, :k], keep, a, lr_t

    stats: list | None = [] if return_stats else None
    out = LogitsKD.apply(student_logits.reshape(-1, local_vocab), student_logits.new_empty(0), cfg, shard, stats,
                         teacher_side, check_labels(labels, cfg, student_logits))
    return shaped(out, stats[0] if return_stats else None, lead)


def nucleus_overflow(lse: torch.Tensor, lse_rest: torch.Tensor, top_p: float, temperature: float, k_max: int,
                     vocab: int, last_values) -> tuple[int, float, int] | None:
    """The rule of `check_nucleus_fits` over any tokens: None when every token's nucleus lies within its cached
    top-K_max, else (how many tokens overflow, their smallest cached mass, a lower bound on the K_max that would serve
    them). `last_values(short)` gives the last cached (centred) value of the tokens in the bool mask `short`: read
    only for those, so a scan over a whole cache (kdexp.teacher.reader.check_nucleus) reads no more of the values."""
    if lse.numel() == 0 or k_max >= vocab:
        return None
    lz = lse.double()
    mass = -torch.expm1(lse_rest.double() - lz)  # the cached top-K_max's share of the teacher's mass
    short = mass < top_p
    count = int(short.sum())
    if not count:
        return None
    last = (last_values(short).double() / temperature - lz[short]).exp()  # the smallest cached probability
    need = k_max + torch.ceil((top_p - mass[short]) / last.clamp_min(1e-300))
    at_least = int(min(vocab, need.max().item())) if bool(torch.isfinite(need).all()) else vocab
    return count, float(mass[short].min()), at_least


def check_nucleus_fits(values: torch.Tensor, lse: torch.Tensor, lse_rest: torch.Tensor, top_p: float,
                       temperature: float, vocab: int) -> None:
    """ValueError unless every token's nucleus lies within its cached top-K_max: the cached mass, 1 - exp(lse_rest -
    lse) from the stored log-sum-exps (O(1) per token), must reach top_p, since the nucleus keeps the next entry iff
    the mass before it is below top_p. The message names how many tokens overflow and a K_max that might serve them:
    a lower bound, since an entry beyond K_max has at most the probability of the last cached one (the cache knows
    no more of the rest than its total)."""
    n, k_max = values.shape
    over = nucleus_overflow(lse, lse_rest, top_p, temperature, k_max, vocab, lambda short: values[short, -1])
    if over is None:
        return
    count, low, at_least = over
    raise ValueError(f"the nucleus top_p={top_p} does not fit in the cached top-{k_max} for {count} of {n} tokens "
                     f"(their cached mass is below top_p, down to {low:.4g}): a cache with "
                     f"teacher.k_max >= {at_least} (a lower bound) might serve them, or bound the nucleus with "
                     f"loss.top_k <= {k_max}, or use teacher=online")
