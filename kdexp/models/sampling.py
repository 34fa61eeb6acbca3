"""One token per row from vocabulary-sharded logits: temperature, top-p, exact across tensor-parallel shards.

``sample_shard(logits, vocab_start=, temperature=, top_p=, seeds=, positions=, group=)`` takes this TP rank's
[b, V/tp] slice of the next-token logits (rank r holds the global ids [vocab_start, vocab_start + V/tp)) and returns,
identical on every rank of `group`, the sampled global ids [b] and their log-probabilities [b] under the distribution
actually sampled from (after temperature and the top-p cut). The whole vocabulary is never gathered: what crosses
ranks is a few [b]-sized (and one [b, 255]-sized) reductions per token.

How, in float64 on every rank:
- z = logits / temperature; log p = z - logsumexp(z) with the log-sum-exp from an all-reduce of the shard maxima and
  of the shard sums of exp(z - max).
- Top-p (the nucleus): the tokens whose z is at least a threshold tau, where tau is the largest logit value at which
  the mass of {z >= tau} still reaches top_p; this is the smallest prefix of the vocabulary sorted by probability with
  mass >= top_p, and tokens tied with the last one are all kept (so the set does not depend on how ties are ordered,
  nor on the TP size). tau is found exactly by a 256-ary search over the order-preserving integer codes of the float32
  logits: each round evaluates the global mass above 255 candidate thresholds (per shard: one searchsorted into the
  shard's sorted codes and a suffix sum of its probabilities; then one all-reduce of [b, 255] sums), so four rounds
  pin the 32-bit threshold. Shard sums are float64: TP sizes can disagree only when the mass above a threshold lies
  within float64 rounding (~1e-16) of top_p.
- The draw: Gumbel-max, argmax over the nucleus of z + g, with g = -log(-log(u)) and u a uniform computed by hashing
  (sample seed, position, global vocabulary id) (splitmix64's finaliser): the noise of a token does not depend on the
  shard that holds it, the TP size, the batch the row sits in, or any generator state. Each rank takes its shard's
  argmax, one all-gather of (value, id, log q) per row picks the global one (ties: the lowest id).
- log q (the recorded sampler log-prob) = z - logsumexp over the nucleus (one more all-reduce).
Non-finite logits other than -inf (masked padding ids) raise ValueError on every rank alike.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

_MASK64 = (1 << 64) - 1
_ROUND = 255  # thresholds per search round: one all-reduce of [b, 255] float64 per round, 4 rounds for 32 bits


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 torch holds (two's complement)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)
_POS = _i64(0xD6E8FEB86659FD93)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    # logical shift of int64 bit patterns (torch's >> is arithmetic)
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64 [b, n]: a hash of (seeds[b], positions[b], ids[n]) through splitmix64's finaliser (int64
    arithmetic wraps modulo 2^64, as the hash means it to), the top 52 bits + 1/2 over 2^52 (53 would round the largest to 1)."""
    x = seeds[:, None] * _GOLDEN + positions[:, None] * _POS + (ids[None, :] + 1) * _MIX2
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 12).double() + 0.5) * 2.0 ** -52


def order_codes(logits: torch.Tensor) -> torch.Tensor:
    """int64 codes of float32 values with the same order (-0.0 counts as +0.0; -inf is the smallest finite code)."""
    bits = (logits.float() + 0.0).view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _logsumexp(z: torch.Tensor, group) -> torch.Tensor:
    """Global log-sum-exp over the last dim of vocabulary-sharded z [b, V/tp] (float64)."""
    m = _all_reduce(z.max(-1).values, dist.ReduceOp.MAX, group)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = _all_reduce(torch.exp(z - safe[:, None]).sum(-1), dist.ReduceOp.SUM, group)
    return safe + torch.log(s)


def nucleus_threshold(codes: torch.Tensor, probs: torch.Tensor, top_p: float, group=None) -> torch.Tensor:
    """The code tau [b] of the top-p cut (see the module docstring): the largest tau with mass{codes >= tau} >= top_p,
    over the whole vocabulary of which `codes`/`probs` [b, V/tp] are this rank's shard. Exact: a 256-ary search on
    integers, the same number of rounds on every rank (its bounds come out of the all-reduce)."""
    order = codes.argsort(-1)
    asc = codes.gather(-1, order)
    # suffix[j] = mass of the sorted shard from j on; one 0 past the end (no code >= tau)
    suffix = torch.cat([probs.gather(-1, order).flip(-1).cumsum(-1).flip(-1),
                        probs.new_zeros(probs.shape[0], 1)], -1)
    b = codes.shape[0]
    lo = torch.full((b,), -(1 << 31) - 1, dtype=torch.long, device=codes.device)  # the whole vocabulary
    hi = torch.full((b,), 1 << 31, dtype=torch.long, device=codes.device)  # nothing: mass 0 < top_p
    steps = torch.arange(1, _ROUND + 1, device=codes.device, dtype=torch.long)
    while bool((hi - lo > 1).any()):
        width = hi - lo
        t = lo[:, None] + torch.div(width[:, None] * steps + _ROUND, _ROUND + 1, rounding_mode="floor")
        t = torch.minimum(t, hi[:, None] - 1).clamp_min(lo[:, None] + 1)  # candidates inside (lo, hi)
        mass = _all_reduce(suffix.gather(-1, torch.searchsorted(asc, t)), dist.ReduceOp.SUM, group)
        ok = mass >= top_p  # non-increasing in t: a prefix of the candidates
        n_ok = ok.sum(-1)
        lo = torch.where(n_ok > 0, t.gather(-1, (n_ok - 1).clamp_min(0)[:, None])[:, 0], lo)
        hi = torch.where(n_ok < _ROUND, t.gather(-1, n_ok.clamp_max(_ROUND - 1)[:, None])[:, 0], hi)
    return lo


def sample_shard(logits: torch.Tensor, *, vocab_start: int, temperature: float, top_p: float, seeds: torch.Tensor,
                 positions: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b] int64, log q [b] float64): one draw per row from this rank's logits shard [b, V/tp]; see the module
    docstring. `seeds` [b] and `positions` [b] (int64) key the noise; `group` is the TP group (None: one shard)."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    z = logits.double() / temperature
    lse = _logsumexp(z, group)
    if not bool(torch.isfinite(lse).all()):  # NaN or +inf anywhere reaches every rank's lse through the sums
        raise ValueError("sampling: the logits hold NaN or +inf (or every id is masked)")
    if top_p < 1:
        codes = order_codes(logits)
        tau = nucleus_threshold(codes, torch.exp(z - lse[:, None]), top_p, group)
        z = z.masked_fill(codes < tau[:, None], -math.inf)
        lse = _logsumexp(z, group)
    ids = torch.arange(logits.shape[-1], device=logits.device) + vocab_start
    score = z + -torch.log(-torch.log(uniforms(seeds.to(logits.device), positions.to(logits.device), ids)))
    best = score.argmax(-1, keepdim=True)  # the first maximum: the lowest id among ties
    mine = torch.stack([score.gather(-1, best)[:, 0], (best[:, 0] + vocab_start).double(),
                        (z.gather(-1, best) - lse[:, None])[:, 0]])  # [3, b]
    if group is not None and dist.get_world_size(group) > 1:
        tp = dist.get_world_size(group)
        every = mine.new_empty((tp * 3, mine.shape[1]))  # concatenated along dim 0 (gloo takes no stacked form)
        dist.all_gather_into_tensor(every, mine, group=group)
        every = every.view(tp, 3, -1)
        rank = every[:, 0].argmax(0, keepdim=True)  # ranks hold ascending ids: the first maximum is the lowest id
        mine = every.gather(0, rank[None].expand(1, 3, -1))[0]
    return mine[1].long(), mine[2]
