"""The fused output head: student hidden states + output weight -> per-token KD / LM losses, chunk by chunk.

`fused_head_loss(hidden, weight, loss_fn, token_weight=...)` is the output layer and any per-token logit loss in one
autograd Function (the idea of Liger-Kernel's fused linear losses, written for kdexp's losses): per chunk of tokens it
forms z = hidden_c @ weight.T (in the weight's dtype, as megatron's output layer does; the losses upcast to float32
themselves), calls loss_fn(z, rows) -> ChunkLoss(kd [c], lm [c] | None, stats) and sums the token-weighted values
(stats: None or a NamedTuple of per-token tensors [c], summed field by field into the same type). The [tokens, V_local] logits, their gradient and the teacher's logits exist one chunk at a
time only. Gradients: hidden_c gets dz @ weight, the weight gets the sum over chunks of dz^T @ hidden_c (accumulated
in float32 for low-precision weights; float64 stays float64), through autograd, so a tied embedding accumulates both
uses and megatron DDP's hooks see an ordinary parameter gradient.

Two modes:
  - coefficients=(w_kd, w_lm): the caller promises total = w_kd * kd + w_lm * lm (the alpha balancer). The gradients
    are computed in the forward pass (one loss backward per chunk, no recompute) and the backward scales them by the
    upstream gradient, which is exact because they are linear in it. If the upstream gradients are not proportional
    to (w_kd, w_lm) (relative tolerance PROPORTIONAL_RTOL), or on a second backward through the same graph, the
    backward falls back to the recompute below, so the result is right either way.
  - coefficients=None: the forward only computes values; the backward forms each chunk again and differentiates
    g_kd * kd + g_lm * lm with the upstream gradients (one more matmul per chunk and a second loss forward).

Tensor parallelism: `weight` is this rank's vocabulary shard and loss_fn reduces its per-row quantities across the
TP group (the existing losses take tp_group). The head never communicates about the hidden-state gradient: each rank
returns its partial dz @ weight_shard, and the caller's input region sums them (megatron's
copy_to_tensor_model_parallel_region, or `tp_copy` here for callers without megatron).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from kdexp.losses._shard import Shard
from kdexp.losses.chunking import accumulation_dtype, head_rows
from kdexp.rules import is_int

_MiB = 1 << 20
# loss.fused_head=auto (the default): the fused head wherever one micro-batch's float32 logits on a TP rank,
# [tokens, V/tp], would take at least AUTO_MIN_LOGITS_BYTES. Above it the logits are what the head saves: at real
# scale 1.16 GiB per model per GPU (docs/scale.md), at Qwen3's vocabulary from 111 tokens per rank on. Below it they
# are small and the chunk loop's fixed costs show: the embedded default's 8 MiB logits train slower fused on a CPU
# (docs/objective.md measures it, with the command).
AUTO_MIN_LOGITS_BYTES = 64 * _MiB
# How far the upstream gradients may be from proportional to `coefficients` before the backward recomputes.
PROPORTIONAL_RTOL = 1e-5


class ChunkLoss(NamedTuple):
    """What loss_fn returns for one chunk of tokens: per-token KD loss [c], LM loss [c] (or None), and stats: None or
    a NamedTuple of per-token tensors [c], one type for every chunk (a field left None is not reported; the trainer's
    terms return kdexp.objective.TermStats)."""

    kd: torch.Tensor
    lm: torch.Tensor | None = None
    stats: tuple | None = None


class HeadResult(NamedTuple):
    """Token-weighted sums (with token_weight = mask / denom: the masked means). lm is None when loss_fn gives none;
    stats: loss_fn's stats type with each field's no-grad token-weighted sum (None where no chunk reported it), or
    None when loss_fn gives none."""

    kd: torch.Tensor
    lm: torch.Tensor | None
    stats: tuple | None


def uses_fused_head(setting, tokens: int, local_vocab: int) -> bool:
    """loss.fused_head resolved: true / false as set; auto: fused when [tokens, local_vocab] float32 logits take
    AUTO_MIN_LOGITS_BYTES or more (tokens: one micro-batch's; local_vocab: the padded vocabulary over the TP size).
    The run (kdexp.objective.build) and kdexp.plan both decide here."""
    if setting != "auto":
        return bool(setting)
    return tokens * local_vocab * 4 >= AUTO_MIN_LOGITS_BYTES


def _check_matrix(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
        got = f"shape {tuple(t.shape)}, {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D floating-point tensor, got {got}")


def _check_head(hidden, weight, hidden_name: str, weight_name: str) -> None:
    _check_matrix(hidden_name, hidden)
    _check_matrix(weight_name, weight)
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{hidden_name} {tuple(hidden.shape)} and {weight_name} {tuple(weight.shape)} disagree on "
                         f"the hidden size ({hidden.shape[1]} vs {weight.shape[1]}): {weight_name} is [V_local, H]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{hidden_name} ({hidden.dtype}) and {weight_name} ({weight.dtype}) must have one dtype")
    if hidden.device != weight.device:
        raise ValueError(f"{hidden_name} ({hidden.device}) and {weight_name} ({weight.device}) must be on one device")


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, loss_fn: Callable[[torch.Tensor, slice], ChunkLoss],
                    *, token_weight: torch.Tensor, coefficients: tuple[float, float] | None = None,
                    chunk_tokens: int | None = None, vocab_size: int | None = None, tp_group=None) -> HeadResult:
    """The KD (and fused LM) loss of the student head, token-weighted, without [n, V_local] logits.

    hidden [n, H] (the full token set of this rank), weight [V_local, H] (this rank's vocabulary shard; tied
    embedding allowed), token_weight [n] (mask / denom). loss_fn(z [c, V_local], rows) -> ChunkLoss, with z in the
    weight's dtype. coefficients: (w_kd, w_lm) when total = w_kd * kd + w_lm * lm (gradients in the forward pass);
    None: recompute in backward. chunk_tokens: tokens per chunk (default: kdexp.losses.chunking.head_rows).
    vocab_size (optional, the padded global vocabulary): checked against weight's rows times the TP size of
    tp_group; tp_group is used for that check and to agree on the chunk size, never for the hidden-state gradient
    (see tp_copy).
    """
    _check_head(hidden, weight, "hidden", "weight")
    n = hidden.shape[0]
    if not isinstance(token_weight, torch.Tensor) or tuple(token_weight.shape) != (n,) \
            or not token_weight.is_floating_point():
        raise ValueError(f"token_weight must be a float tensor of shape ({n},) (one weight per row of hidden), got "
                         f"{getattr(token_weight, 'shape', token_weight)!r}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable (z, rows) -> ChunkLoss, got {type(loss_fn).__name__}")
    if coefficients is not None:
        if len(coefficients) != 2 or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                             and math.isfinite(c) for c in coefficients):
            raise ValueError(f"coefficients must be None or two finite numbers (w_kd, w_lm), got {coefficients!r}")
        coefficients = (float(coefficients[0]), float(coefficients[1]))
    if chunk_tokens is not None and (not is_int(chunk_tokens) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")
    shard = Shard.make(weight.shape[0], tp_group, weight.device)
    if vocab_size is not None:
        if not is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
        if vocab_size % shard.world or weight.shape[0] != vocab_size // shard.world:
            raise ValueError(f"weight has {weight.shape[0]} rows, but vocab_size {vocab_size} over a TP size of "
                             f"{shard.world} needs {vocab_size / shard.world:g} rows per rank (megatron pads the "
                             "vocabulary to a multiple of the TP size)")
    rows = head_rows(n, shard.max_local_vocab, weight.dtype, chunk_tokens)
    side: dict = {}
    kd, lm, stats = _FusedHead.apply(hidden, weight, token_weight.detach(), loss_fn, coefficients, rows, side)
    return HeadResult(kd, lm if side["has_lm"] else None, _unpack_stats(stats, side["stat_type"], side["stat_fields"]))


class _StatSums:
    """The token-weighted sums of loss_fn's stats, field by field, and their type (checked to be one NamedTuple)."""

    def __init__(self):
        self.type, self.sums = None, []

    def add(self, stats, tw: torch.Tensor, acc: torch.dtype) -> None:
        if stats is None:
            return
        if not (isinstance(stats, tuple) and hasattr(stats, "_fields")):
            raise ValueError(f"loss_fn's ChunkLoss.stats must be None or a NamedTuple of per-token tensors, got "
                             f"{type(stats).__name__}")
        if self.type is None:
            self.type, self.sums = type(stats), [None] * len(stats)
        elif type(stats) is not self.type:
            raise ValueError(f"loss_fn must return one stats type for every chunk, got {self.type.__name__} and "
                             f"{type(stats).__name__}")
        for i, v in enumerate(stats):
            if v is not None:
                part = (v.detach().to(acc) * tw).sum()
                self.sums[i] = part if self.sums[i] is None else self.sums[i] + part

    def packed(self, like: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The reported sums stacked into one tensor (an autograd Function's output) and their field positions."""
        fields = [i for i, v in enumerate(self.sums) if v is not None]
        return (torch.stack([self.sums[i] for i in fields]) if fields else like.new_zeros(0)), fields


def _unpack_stats(stacked: torch.Tensor, stat_type, fields: list[int]):
    if stat_type is None:
        return None
    values = [None] * len(stat_type._fields)
    for j, i in enumerate(fields):
        values[i] = stacked[j]
    return stat_type(*values)


def _chunks(n: int, rows: int):
    for r0 in range(0, n, rows):
        yield slice(r0, min(n, r0 + rows))


def _logits(hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden_c @ weight.T in the weight dtype (as megatron's ColumnParallelLinear output layer). On CPU as
    (weight @ hidden_c.T).T made contiguous: MKL runs the [V, H] x [H, c] shape at the speed of one full-size
    matmul, and a [c, H] x [H, V] one with a short chunk (tens of rows) well below it; the transpose copy is one
    pass over the chunk."""
    if hidden_c.device.type == "cpu":
        return torch.mm(weight, hidden_c.T).T.contiguous()
    return hidden_c @ weight.T


def _chunk_grad(out: ChunkLoss, z: torch.Tensor, g_kd, g_lm) -> torch.Tensor:
    """d(sum g_kd * kd + g_lm * lm)/dz for one chunk (g_*: per-token weights [c]); zeros when nothing depends on z."""
    outs, grads = [], []
    for loss, g in ((out.kd, g_kd), (out.lm, g_lm)):
        if loss is not None and g is not None and loss.requires_grad:
            outs.append(loss)
            grads.append(g.to(loss.dtype))
    gz = torch.autograd.grad(outs, z, grads, allow_unused=True)[0] if outs else None
    return torch.zeros_like(z) if gz is None else gz


class _Grads:
    """The hidden / weight gradients filled chunk by chunk (the weight's summed in `acc`, float32 or float64)."""

    def __init__(self, hidden, weight, need_h: bool, need_w: bool):
        self.weight_dtype = weight.dtype
        self.h = torch.empty_like(hidden) if need_h else None
        acc = accumulation_dtype(weight.dtype)
        self.w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None

    def add(self, r: slice, gz: torch.Tensor, hidden_c: torch.Tensor, weight: torch.Tensor) -> None:
        if self.h is not None:
            torch.mm(gz, weight, out=self.h[r])
        if self.w is not None:
            if gz.dtype == self.w.dtype:  # as w^T += hidden_c^T gz: on CPU the faster of the two orientations
                self.w.T.addmm_(hidden_c.T, gz)
            else:  # a bf16 partial (fp32 accumulation inside the matmul), summed over chunks in float32
                self.w.add_(gz.T @ hidden_c)

    def result(self):
        w = self.w if self.w is None or self.w.dtype == self.weight_dtype else self.w.to(self.weight_dtype)
        return self.h, w


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, token_weight, loss_fn, coefficients, rows, side):
        n = hidden.shape[0]
        acc = accumulation_dtype(weight.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        eager = coefficients is not None and (need_h or need_w)
        grads = _Grads(hidden, weight, need_h, need_w) if eager else None
        kd_sum = torch.zeros((), dtype=acc, device=hidden.device)
        lm_sum = torch.zeros_like(kd_sum)
        stat_sums = _StatSums()
        has_lm = None
        for r in _chunks(n, rows):
            h = hidden[r]
            tw = token_weight[r].to(acc)
            z = _logits(h, weight)
            with torch.enable_grad():
                z.requires_grad_(eager)
                out = loss_fn(z, r)
                if has_lm is None:
                    has_lm = out.lm is not None
                if (out.lm is not None) != has_lm:
                    raise ValueError("loss_fn must return lm for every chunk or for none")
                kd_sum += (out.kd.detach().to(acc) * tw).sum()
                if has_lm:
                    lm_sum += (out.lm.detach().to(acc) * tw).sum()
                stat_sums.add(out.stats, tw, acc)
                if eager:
                    w_kd, w_lm = coefficients
                    gz = _chunk_grad(out, z, tw * w_kd, tw * w_lm if has_lm else None)
            if eager:
                grads.add(r, gz, h, weight)
                del gz  # before the next chunk's logits: one chunk's gradient alive at a time
            del z, out
        stats, fields = stat_sums.packed(kd_sum)
        side.update(stat_type=stat_sums.type, stat_fields=fields, has_lm=bool(has_lm))
        ctx.save_for_backward(hidden, weight, token_weight)
        ctx.loss_fn, ctx.rows, ctx.coefficients, ctx.has_lm = loss_fn, rows, coefficients, bool(has_lm)
        ctx.grads = grads.result() if eager else None
        ctx.mark_non_differentiable(stats)
        if not has_lm:
            ctx.mark_non_differentiable(lm_sum)
        return kd_sum, lm_sum, stats

    @staticmethod
    def backward(ctx, g_kd, g_lm, _g_stats):
        hidden, weight, token_weight = ctx.saved_tensors
        held, ctx.grads = ctx.grads, None  # scaled in place once: a second backward (retain_graph) recomputes
        if held is not None:
            scale = _proportional(g_kd, g_lm if ctx.has_lm else None, ctx.coefficients)
            if scale is not None:
                gh, gw = held
                return (_scaled_(gh, scale), _scaled_(gw, scale), None, None, None, None, None)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = _Grads(hidden, weight, need_h, need_w)
        acc = accumulation_dtype(weight.dtype)
        for r in _chunks(hidden.shape[0], ctx.rows):
            h = hidden[r]
            tw = token_weight[r].to(acc)
            z = _logits(h, weight)
            with torch.enable_grad():
                z.requires_grad_(True)
                out = ctx.loss_fn(z, r)
                gz = _chunk_grad(out, z, None if g_kd is None else tw * g_kd.to(acc),
                                 None if g_lm is None or not ctx.has_lm else tw * g_lm.to(acc))
            grads.add(r, gz, h, weight)
            del z, out, gz
        gh, gw = grads.result()
        return gh, gw, None, None, None, None, None


def _proportional(g_kd, g_lm, coefficients) -> float | None:
    """s with (g_kd, g_lm) = s (w_kd, w_lm) (a missing upstream gradient counts as 0), or None if there is none."""
    w = [coefficients[0]] + ([coefficients[1]] if g_lm is not None else [])
    g = [0.0 if g_kd is None else float(g_kd)] + ([float(g_lm)] if g_lm is not None else [])
    i = max(range(len(w)), key=lambda j: abs(w[j]))
    if w[i] == 0.0:
        return 0.0 if all(x == 0.0 for x in g) else None
    s = g[i] / w[i]
    tol = PROPORTIONAL_RTOL * abs(s) * abs(w[i])
    return s if all(abs(gj - s * wj) <= tol for gj, wj in zip(g, w)) else None


def _scaled_(t: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    if t is None or scale == 1.0:
        return t
    return t.mul_(scale)


def teacher_head_logits(hidden_t: torch.Tensor, weight_t: torch.Tensor, rows: slice) -> torch.Tensor:
    """The online teacher's logits for the token rows `rows`: hidden_t[rows] @ weight_t.T, [c, V_local] in the weight's
    dtype, without grad (loss_fn forms one chunk at a time with it)."""
    _check_head(hidden_t, weight_t, "hidden_t", "weight_t")
    with torch.no_grad():
        return _logits(hidden_t[rows], weight_t)


class _TPCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def tp_copy(hidden: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient over `group` in backward: megatron's
    copy_to_tensor_model_parallel_region in pure torch. Put it before fused_head_loss when each TP rank holds a
    vocabulary shard, so that the hidden states get the sum of the ranks' partial gradients."""
    if group is None or dist.get_world_size(group) == 1:
        return hidden
    return _TPCopy.apply(hidden, group)
