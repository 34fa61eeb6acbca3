"""Vocabulary-shard bookkeeping for the logit losses under tensor parallelism.

A `Shard` describes this rank's contiguous slice of the vocabulary (Megatron's vocab-parallel output layer gives
rank r the columns [offset_r, offset_r + local_vocab_r) in rank order) and wraps the few collectives the losses need.
Without a group every collective is a no-op, so the loss code has one path for TP=1 and TP>1.

All collectives here are plain `torch.distributed` calls made inside an autograd.Function's forward: they carry no
autograd meaning, which is what keeps the gradient free of a factor of the TP size (the backward of the loss computes
each rank's slice directly and never communicates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    group: object | None
    world: int
    rank: int
    offset: int  # global index of this rank's first vocabulary column
    local_vocab: int
    vocab: int  # global vocabulary size
    max_local_vocab: int  # the same on every rank: chunk sizes are derived from it so all ranks agree

    @staticmethod
    def make(local_vocab: int, tp_group, device: torch.device) -> "Shard":
        if tp_group is None or dist.get_world_size(tp_group) == 1:
            return Shard(None, 1, 0, 0, local_vocab, local_vocab, local_vocab)
        world = dist.get_world_size(tp_group)
        rank = dist.get_rank(tp_group)
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([local_vocab], dtype=torch.long, device=device), group=tp_group)
        sizes = [int(s.item()) for s in sizes]
        return Shard(tp_group, world, rank, sum(sizes[:rank]), local_vocab, sum(sizes), max(sizes))

    def all_reduce_(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def logsumexp_(self, x: torch.Tensor) -> torch.Tensor:
        """log(sum over ranks of exp(x)) per element, for per-rank log-sum-exps x ([c]; -inf allowed)."""
        if self.world == 1:
            return x
        m = x.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all ranks -inf: exp(-inf - 0) = 0 -> -inf
        s = (x - m).exp()
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self.group)
        return s.log() + m

    def row_max(self, raw: torch.Tensor, cdtype: torch.dtype) -> torch.Tensor:
        """Max over the whole (global) vocabulary of each row of a raw [c, V_local] chunk, in cdtype; 0 where a row is
        all -inf (so that centring on it never makes NaN)."""
        m = self.all_reduce_(raw.amax(1).to(cdtype), op=dist.ReduceOp.MAX)
        return torch.where(torch.isfinite(m), m, torch.zeros_like(m))

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when `flag` is True on any rank (a host sync; used only by the growing Top-P search)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def global_topk(self, raw: torch.Tensor, k: int, cdtype: torch.dtype, sort: bool):
        """Teacher's global top-k of one chunk: (raw values in cdtype, global indices), sorted descending if `sort`.

        Ties: among equal values the lower global id wins, for the set (at the k-th value) and for the order, on
        every TP size and in the cache writer alike (teacher_topk_record calls this), so a cached loss keeps the
        entries the online loss keeps (torch.topk alone leaves ties in any order).

        Each rank takes its local top-min(k, local_vocab) (lowest ids at a tie: a global winner is a local one); the
        union (all_gather of values and global indices) holds the global top-k, which a sort by (value, id)
        extracts. The values stay raw (not divided by T): the caller centres them on the row max first. The
        full-vocabulary topk runs unsorted (a quarter cheaper on CPU); only the k winners get sorted.
        """
        lv, li = _topk_lowest_ids(raw, min(k, self.local_vocab))
        lv = lv.to(cdtype)
        if self.world == 1:
            return _sorted(lv, li) if sort else (lv, li)
        li = li + self.offset
        # One all_gather for values and indices: float64 holds both exactly (indices < 2**53).
        packed = torch.stack([lv.double(), li.double()], dim=-1)
        width = min(k, self.max_local_vocab)  # all_gather needs equal sizes: pad a smaller shard with -inf values
        if packed.shape[1] < width:
            pad = packed.new_zeros(packed.shape[0], width - packed.shape[1], 2)
            pad[..., 0] = -float("inf")
            pad[..., 1] = float(self.vocab)  # after every real id at a -inf tie
            packed = torch.cat([packed, pad], dim=1)
        packed = packed.contiguous()
        parts = [torch.empty_like(packed) for _ in range(self.world)]
        dist.all_gather(parts, packed, group=self.group)
        union = torch.cat(parts, dim=1)
        vals, gidx = _sorted(union[..., 0], union[..., 1].long())
        return vals[:, :k].to(cdtype), gidx[:, :k].contiguous()

    def local_index(self, gidx: torch.Tensor, keep: torch.Tensor | None = None):
        """(local column or `local_vocab` (a scratch column) where not owned / not kept, owned mask). Without TP every
        index is owned: (gidx itself, None) when nothing is masked either, no pass over the indices."""
        if self.world == 1:
            if keep is None:
                return gidx, None
            return torch.where(keep, gidx, self.local_vocab), keep
        lidx = gidx - self.offset
        owned = (lidx >= 0) & (lidx < self.local_vocab)
        if keep is not None:
            owned = owned & keep
        return torch.where(owned, lidx, torch.full_like(lidx, self.local_vocab)), owned


def _topk_lowest_ids(x: torch.Tensor, k: int):
    """torch.topk(x, k, sorted=False) with ties at the k-th value resolved to the lowest ids. The top k + 1 (the same
    one pass over the vocabulary) tell where a tie straddles the boundary: their two smallest values are equal. Other
    rows drop their smallest; those rows (rare: equal logits) are re-selected exactly (every entry above the k-th
    value, then the lowest ids equal to it)."""
    if k >= x.shape[-1] or x.shape[0] == 0:
        return torch.topk(x, k, dim=-1, sorted=False)
    vals, idx = torch.topk(x, k + 1, dim=-1, sorted=False)
    low = torch.topk(vals, 2, dim=-1, largest=False)  # [c, 2], ascending: the (k+1)-th and the k-th value
    # drop the (k+1)-th: move the last column into its place, then cut the last column off
    pos = low.indices[:, :1]
    vals.scatter_(1, pos, vals[:, k:].clone())
    idx.scatter_(1, pos, idx[:, k:].clone())
    vals, idx = vals[:, :k], idx[:, :k]
    fix = low.values[:, 0] == low.values[:, 1]
    if not bool(fix.any()):
        return vals, idx
    rows = fix.nonzero()[:, 0]
    xb, tb = x[rows], low.values[rows, :1]
    above, eq = xb > tb, xb == tb
    room = k - above.sum(1, keepdim=True)  # > 0: the k-th value ties with the (k+1)-th
    take = above | (eq & (eq.cumsum(1) <= room))  # exactly k per row
    ib = take.nonzero()[:, 1].view(-1, k)  # ascending ids
    vals[rows], idx[rows] = xb.gather(1, ib), ib
    return vals, idx


def _by_rule(vals: torch.Tensor, idx: torch.Tensor):
    """(vals, idx) ordered by the tie rule of global_topk, value descending, then id ascending: ids sorted first,
    then a stable sort by value."""
    idx, by_id = torch.sort(idx, dim=-1)
    vals, order = torch.sort(vals.gather(-1, by_id), dim=-1, descending=True, stable=True)
    return vals, idx.gather(-1, order)


def _sorted(vals: torch.Tensor, idx: torch.Tensor):
    """[rows, k] (vals, idx) ordered by the tie rule (_by_rule) with one sort by value; only rows holding equal values
    (rare: equal logits, bf16, -inf padding) or NaNs, where that sort's order is arbitrary, are ordered by the rule."""
    vals, order = torch.sort(vals, dim=-1, descending=True)
    idx = idx.gather(-1, order)
    tied = ((vals[:, 1:] == vals[:, :-1]) | vals[:, 1:].isnan()).any(-1)  # NaNs too: the rule orders them by id
    if bool(tied.any()):
        rows = tied.nonzero()[:, 0]
        vals[rows], idx[rows] = _by_rule(vals[rows], idx[rows])
    return vals, idx


def check_ids(ids: torch.Tensor, vocab: int, what: str) -> None:
    """Integer ids in [0, vocab) (the global vocabulary): IndexError naming the first bad one (a gather or the CPU
    kernel would otherwise read outside the logits). One reduction over [n, S] and a host sync."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    out = (ids < 0) | (ids >= vocab)
    if ids.numel() and bool(out.any()):
        r, j = (int(i) for i in out.nonzero()[0])
        raise IndexError(f"{what} {ids[r, j].item()} in row {r} (slot {j}) out of range [0, {vocab}) (the "
                         "student's vocabulary)")
