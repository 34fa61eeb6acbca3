"""The logit KD loss's autograd Function (private: the chunk-kernel layer), shared by kdexp.losses.logits (online
teacher) and kdexp.losses.cached (a cache record's teacher half).

`LogitsKD.apply(student [n, V_local], teacher [n, V_local], cfg, shard, stats, teacher_side, labels)` computes the
per-token loss chunk by chunk over tokens in float32 (float64 for float64 inputs) and saves only the inputs plus
O(K) values per token; backward recomputes the student softmax per chunk. Dense KD runs the full-vocabulary
divergence on each chunk (kdexp.losses.divergence); Top-K / Top-P run kdexp.losses._sparse's teacher and student
halves. One exception to the recompute: Top-K without a nucleus cut on float32 logits without TP (holds_gradient)
computes the student's exps outside S straight into the rows of the gradient tensor (allocated in forward instead
of backward: no extra memory), which the backward then scales in place instead of recomputing them. On CPU that
path's student half (and its backward) runs in a compiled kernel (kdexp.losses._native: the same values in one
pass per row; the eager code is its reference and its fallback). Per chunk and distribution the full-vocabulary
work is one copy into a scratch buffer, one fused (in-place on CPU) log_softmax / softmax and two cheap max
reductions; the teacher adds one unsorted topk.
"""

from __future__ import annotations

import torch

from kdexp.losses import _native
from kdexp.losses._chunks import (KDStats, KernelConfig, Labels, compute_dtype, dense_chunks, holds_gradient,
                                  log_softmax_, lse_, softmax_)
from kdexp.losses._shard import Shard
from kdexp.losses._sparse import SplitGrad, student_half, teacher_half
from kdexp.losses.chunking import logit_rows, native_rows
from kdexp.losses.divergence import dense_backward_, dense_forward_


class LogitsKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, cfg: KernelConfig, shard: Shard, stats, teacher_side=None, labels=None):
        # stats: None, or a list the forward appends the per-token KDStats to (a Function returns tensors only).
        # teacher_side(rows) -> (gidx, keep, a, lr_t): the teacher half of a sparse chunk from elsewhere (a cache);
        # `teacher` is then unused. labels [n] (sparse, T = 1): the LM cross-entropy too, returned second.
        n, vl = student.shape
        dev = student.device
        cd = compute_dtype(student)
        rows = logit_rows(n, shard.max_local_vocab, cd, cfg.chunk_tokens)
        dense = cfg.top_k is None and cfg.top_p is None
        loss = torch.empty(n, dtype=cd, device=dev)
        st = KDStats(*(torch.empty(n, dtype=cd, device=dev) for _ in KDStats._fields)) if stats is not None else None
        ctx.cfg, ctx.shard, ctx.rows, ctx.dense, ctx.cd = cfg, shard, rows, dense, cd
        if dense:
            # log_softmax centres each row itself, exactly when nothing was divided before it; a division by T or the
            # local-to-global log-sum-exp shift under TP (a difference of two values ~max|x|) needs the centring.
            centres = None
            if cfg.temperature != 1.0 or shard.world > 1:
                centres = torch.stack([shard.row_max(teacher, cd), shard.row_max(student, cd)])
            shift = torch.zeros(2, n, dtype=cd, device=dev)  # local minus global log-sum-exp (0 without TP)
            aux = torch.empty(n, dtype=cd, device=dev)
            for r, (xt, ot), (xs, os_) in dense_chunks(student, teacher, rows, cfg.temperature, cd, centres):
                if shard.world == 1:
                    a, b = log_softmax_(xt), log_softmax_(xs)
                else:
                    lse_t, loc_t, a = lse_(xt, shard, ot)
                    lse_s, loc_s, b = lse_(xs, shard, os_)
                    shift[0, r], shift[1, r] = loc_t - lse_t, loc_s - lse_s
                    a.add_(shift[0, r, None])
                    b.add_(shift[1, r, None])
                part = shard.all_reduce_(dense_forward_(a, b, cfg.divergence, cfg.beta))
                loss[r], aux[r] = part[:, 0], part[:, 1]
            ctx.save_for_backward(student, teacher)
            ctx.label, ctx.held = None, None
            ctx.shift, ctx.aux, ctx.raw_loss, ctx.centres = shift, aux, loss.clone(), centres
            if st is not None:
                st.teacher_kept_mass.fill_(1.0)
                st.student_kept_mass.fill_(1.0)
                st.nucleus_size.fill_(shard.vocab)
                st.teacher_residual_mass.zero_()
                st.student_residual_mass.zero_()
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
                rows = ctx.rows = native_rows(n, rows, cfg.top_k)  # from a cache on the CPU kernel
            buf = torch.empty(rows, vl + 1, dtype=cd, device=dev) if held is None else None
            chunks = []
            label = None if labels is None else Labels.make(labels, vl, shard, dev)
            label_logit = None if label is None else label.logits(student, shard, cd)
            lm = None if labels is None else torch.empty(n, dtype=cd, device=dev)
            for r0 in range(0, n, rows):
                r = slice(r0, min(n, r0 + rows))
                b = buf[: r.stop - r.start] if held is None else held[r]
                side = (teacher_half(teacher[r], b, cfg, shard, cd, st is not None) if teacher_side is None
                        else teacher_side(r, cd))
                out = student_half(student[r], b, cfg, shard, cd, st is not None, *side, lm=labels is not None,
                                    held=held is not None)
                loss[r] = out.loss
                if label is not None:  # -log q(label) = lse - (x_label - centre): both centred, as megatron's
                    lm[r] = torch.where(label.valid[r], out.lse - (label_logit[r] - out.centre), 0.0)
                chunks.append((r, out.gidx, out.keep, out.cand_grad, out.coef, out.centre, out.q, out.exp_sum))
                if st is not None:
                    for whole, part in zip(st, out.stats):
                        whole[r] = part
            ctx.held = held
            # The kept ids go through save_for_backward: a cached record's ids are the caller's tensor, and autograd's
            # version check refuses a backward after they changed in place (the CPU kernel checks them again)
            ctx.save_for_backward(student, *(c[1] for c in chunks))
            ctx.chunks, ctx.label = [c[:1] + c[2:] for c in chunks], label
        if st is not None:
            stats.append(st._replace(nucleus_size=st.nucleus_size.long()))
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
            for r, (xt, _), (xs, _) in dense_chunks(student, teacher, rows, cfg.temperature, cd, ctx.centres):
                if cfg.divergence == "forward_kl":  # q - p straight from the fused softmax
                    p, q = softmax_(xt), softmax_(xs)
                    if shard.world > 1:
                        p.mul_(ctx.shift[0, r, None].exp())
                        q.mul_(ctx.shift[1, r, None].exp())
                    g = q.sub_(p)
                else:
                    a, b = log_softmax_(xt), log_softmax_(xs)
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
                    native = isinstance(cand_grad, SplitGrad) and _native.serves(student, held)
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
            if isinstance(cand_grad, SplitGrad):  # e (w sc + gl / total) - p sc: two passes over S
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
