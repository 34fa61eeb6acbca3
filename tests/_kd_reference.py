"""Independent float64 reference for kdexp.losses.logits_kd_loss, written from the definition (one token at a time,
full softmax, argsort, explicit probability vectors), sharing no code with the implementation. Ties in the teacher's
order go to the lower vocabulary id (a stable sort), the rule both the online and the cached loss follow."""

from __future__ import annotations

import torch


def _divergence(P: torch.Tensor, Q: torch.Tensor, divergence: str, beta: float) -> torch.Tensor:
    def kl(x, y):  # sum x log(x / y) over x > 0
        pos = x > 0
        return (x[pos] * (x[pos].log() - y[pos].log())).sum()

    if divergence == "forward_kl":
        return kl(P, Q)
    if divergence == "reverse_kl":
        return kl(Q, P)
    M = beta * P + (1 - beta) * Q
    return beta * kl(P, M) + (1 - beta) * kl(Q, M)


def reference_kd(student, teacher, *, temperature=1.0, top_k=None, top_p=None, min_k=1, ghost_token=True,
                 normalization="full", divergence="forward_kl", beta=0.5, scale_by_temperature_squared=False):
    """Returns (loss [N], stats dict of lists) in float64; differentiable w.r.t. `student` ([N, V])."""
    s = student.double() / temperature
    t = teacher.double().detach() / temperature
    n, v = s.shape
    q_all = torch.softmax(s, -1)
    p_all = torch.softmax(t, -1)
    losses, kept_t, kept_s, sizes, resid_t, resid_s = [], [], [], [], [], []
    for i in range(n):
        order = torch.argsort(p_all[i], descending=True, stable=True)  # ties: the lower vocabulary id first
        cand = order[: (top_k if top_k is not None else v)]
        pc = p_all[i, cand]
        if top_p is not None:
            cum = torch.cumsum(pc, 0)
            keep = (cum - pc) < top_p
            keep[:min_k] = True
        else:
            keep = torch.ones(len(cand), dtype=torch.bool)
        S = cand[keep]
        outside = torch.ones(v, dtype=torch.bool)
        outside[S] = False
        P, Q = p_all[i, S], q_all[i, S]
        kept_t.append(float(P.detach().sum()))
        kept_s.append(float(Q.detach().sum()))
        sizes.append(len(S))
        rt, rs = p_all[i, outside].sum(), q_all[i, outside].sum()  # residual = mass outside S, by definition
        resid_t.append(float(rt.detach()))
        resid_s.append(float(rs.detach()))
        if normalization == "renormalize":
            P, Q = P / P.sum(), Q / Q.sum()
        elif ghost_token and bool(outside.any()):
            P, Q = torch.cat([P, rt[None]]), torch.cat([Q, rs[None]])
        losses.append(_divergence(P, Q, divergence, beta))
    loss = torch.stack(losses)
    if scale_by_temperature_squared:
        loss = loss * temperature**2
    return loss, {"teacher_kept_mass": kept_t, "student_kept_mass": kept_s, "nucleus_size": sizes,
                  "teacher_residual_mass": resid_t, "student_residual_mass": resid_s}
