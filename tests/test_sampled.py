"""Sampled KD (kdexp.losses.sampled): unbiased gradient (statistical test against the float64 full forward-KL gradient,
top-K biased on the same toy), the sparse cross-entropy's backward against autograd, deterministic draws per
(seed, step), the same draws and gradients at TP=2 (2 gloo processes) as at TP=1."""

import pytest
import torch

from kdexp.distributed.testing import run_on_processes
from kdexp.losses import logits_kd_loss
from kdexp.losses.sampled import sample_teacher, sampled_kd_loss, step_seed

V = 64
DRAWS = 2000
Z_MAX = 5.0  # per-coordinate bound: under an unbiased estimator P(max over 64 |z| > 5) ~ 4e-5; seeds are fixed


def _toy(seed=0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(V, generator=g, dtype=torch.float64) * 2.5
    student = torch.randn(V, generator=g, dtype=torch.float64)
    return teacher, student


def _exact_grad(student, teacher, T=1.0):
    """d KL(softmax(t/T) || softmax(s/T)) / d s = (softmax(s/T) - softmax(t/T)) / T, by hand in float64."""
    p = torch.exp(teacher / T) / torch.exp(teacher / T).sum()
    q = torch.exp(student / T) / torch.exp(student / T).sum()
    return (q - p) / T


def _standard_error(student, teacher, samples, T=1.0, proposal=None):
    """Exact standard error of the mean per-draw gradient over DRAWS, from the multinomial covariance (no empirical
    variance: an id never drawn would get 0). With plain importance weights w = diag(r) c / S, r = p / q,
    c ~ Multinomial(S, q), the gradient w.r.t. z = s * T is g = (s r^T - diag(r)) c / (S T), so
    Cov(g) = A (diag(q) - q q^T) A^T / (S T^2). At proposal == target (r = 1) the normalised weights are the same."""
    proposal = T if proposal is None else proposal
    p, q = torch.softmax(teacher / T, 0), torch.softmax(teacher / proposal, 0)
    s = torch.softmax(student / T, 0)
    r = p / q
    A = s[:, None] * r[None, :] - torch.diag(r)
    cov = A @ (torch.diag(q) - q[:, None] * q[None, :]) @ A.T / (samples * T ** 2)
    return (cov.diagonal() / DRAWS).sqrt()


def _per_draw_grads(student, teacher, *, samples, T=1.0, proposal=None, normalize=True, seed=7):
    """One row per independent draw of `samples` ids (the same token repeated): per-row gradients [DRAWS, V]."""
    t = teacher.expand(DRAWS, V).contiguous()
    s = student.expand(DRAWS, V).clone().requires_grad_(True)
    draw = sample_teacher(t, samples=samples, proposal_temperature=T if proposal is None else proposal,
                          temperature=T, seed=seed, normalize=normalize)
    loss = sampled_kd_loss(s, draw.ids, draw.weights, draw.teacher_logprobs, temperature=T)
    loss.sum().backward()
    return s.grad, loss.detach(), draw


@pytest.mark.parametrize("samples,T,proposal,normalize", [(8, 1.0, None, True), (3, 1.5, None, True),
                                                         (8, 1.0, 2.0, False)])
def test_mean_gradient_is_the_full_forward_kl_gradient(samples, T, proposal, normalize):
    teacher, student = _toy()
    grads, losses, draw = _per_draw_grads(student, teacher, samples=samples, T=T, proposal=proposal,
                                          normalize=normalize)
    exact = _exact_grad(student, teacher, T)
    se = _standard_error(student, teacher, samples, T, proposal)
    z = (grads.mean(0) - exact) / se
    assert z.abs().max() < Z_MAX, f"max |z| = {z.abs().max():.2f}"
    assert (z ** 2).mean() < 1.6  # chi-square / dof: ~1 for an unbiased estimator (64 dof: sd of the mean ~0.18)
    # The value estimates the full-vocabulary forward KL.
    p, logq = torch.softmax(teacher / T, 0), torch.log_softmax(student / T, 0)
    kl = (p * (p.log() - logq)).sum()
    assert abs(losses.mean() - kl) < Z_MAX * losses.std() / DRAWS ** 0.5
    # Unique ids per token, counts sum to the draws; normalised weights sum to 1, plain ones to 1 in expectation.
    assert (draw.counts.sum(-1) == samples).all()
    if normalize:
        torch.testing.assert_close(draw.weights.sum(-1), torch.ones(DRAWS, dtype=torch.float64))
    else:
        wsum = draw.weights.sum(-1)
        assert abs(wsum.mean() - 1) < Z_MAX * wsum.std() / DRAWS ** 0.5


def test_self_normalised_weights_are_biased_with_another_proposal():
    """Why loss.normalize_weights exists: with a flatter proposal (2.0 vs 1.0) and 8 draws the paper's normalised
    weights miss the full gradient by many standard errors, the plain importance weights (above) do not."""
    teacher, student = _toy()
    grads, _, _ = _per_draw_grads(student, teacher, samples=8, proposal=2.0, normalize=True)
    z = (grads.mean(0) - _exact_grad(student, teacher)) / _standard_error(student, teacher, 8, 1.0, 2.0)
    assert z.abs().max() > Z_MAX and (z ** 2).mean() > 5  # (measured: max |z| 8.3, chi-square / dof 11.8)


def test_topk_gradient_is_biased_where_sampled_is_not():
    teacher, student = _toy()
    grads, _, _ = _per_draw_grads(student, teacher, samples=8)
    exact = _exact_grad(student, teacher)
    se = _standard_error(student, teacher, 8)
    sampled_z = ((grads.mean(0) - exact) / se).abs().max()
    for kw in (dict(top_k=8), dict(top_k=8, ghost_token=False, normalization="renormalize")):
        s = student[None].clone().requires_grad_(True)
        logits_kd_loss(s, teacher[None], **kw).sum().backward()
        bias_z = ((s.grad[0] - exact) / se).abs().max()
        assert bias_z > 10 * Z_MAX and bias_z > 20 * sampled_z, (kw, float(bias_z), float(sampled_z))


def test_backward_matches_autograd_of_the_sparse_cross_entropy():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (5, 4), generator=g)
    w = torch.rand(5, 4, generator=g, dtype=torch.float64)
    w[0, 3] = 0.0  # an unused slot
    lp = -torch.rand(5, 4, generator=g, dtype=torch.float64)
    T = 1.7
    a = z.clone().requires_grad_(True)
    out = sampled_kd_loss(a, ids, w, lp, temperature=T, scale_by_temperature_squared=True)
    b = z.clone().requires_grad_(True)
    ref = T ** 2 * (w * (lp - torch.log_softmax(b / T, -1).gather(1, ids))).sum(1)
    torch.testing.assert_close(out, ref.detach())
    gw = torch.rand(5, generator=g, dtype=torch.float64)
    (out * gw).sum().backward()
    (ref * gw).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_draws_are_deterministic_per_seed_and_step():
    t = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    a = sample_teacher(t, samples=5, seed=step_seed(1234, 10))
    b = sample_teacher(t, samples=5, seed=step_seed(1234, 10))
    c = sample_teacher(t, samples=5, seed=step_seed(1234, 11))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.counts, b.counts)
    assert not torch.equal(a.ids, c.ids)
    assert step_seed(1234, 10, 0) != step_seed(1234, 10, 1) != step_seed(1235, 10, 0)


def test_draws_from_logit_rows_are_the_draws_from_the_whole_tensor(monkeypatch):
    """LogitRows (the fused head's teacher: logits formed chunk by chunk, never whole) gives the ids, counts, logits
    and normalisers the [n, V] tensor gives; the chunks cover every row once and none is the whole batch."""
    from kdexp.losses import LogitRows, chunking

    monkeypatch.setattr(chunking, "SAMPLED_BYTES", 3 * V * 8 * 3)  # 3 rows per chunk
    t = torch.randn(10, V, generator=torch.Generator().manual_seed(2)) * 3
    asked = []

    def rows(r: slice) -> torch.Tensor:
        asked.append((r.start, r.stop))
        return t[r].clone()

    src = LogitRows(10, V, t.dtype, t.device, rows)
    for kw in (dict(temperature=1.0), dict(temperature=0.7, proposal_temperature=1.3)):
        asked.clear()
        whole = sample_teacher(t, samples=7, seed=5, **kw)
        chunked = sample_teacher(src, samples=7, seed=5, **kw)
        for a, b in zip(whole, chunked):
            assert torch.equal(a, b)
        assert asked == [(0, 3), (3, 6), (6, 9), (9, 10)]


def _tp_worker(rank, world, teacher, student, seed):
    import kdexp.distributed as kd

    kd.initialize(tensor_parallel=2)
    lo, hi = rank * V // 2, (rank + 1) * V // 2
    draw = sample_teacher(teacher[:, lo:hi].contiguous(), samples=16, proposal_temperature=1.3, temperature=0.8,
                          seed=seed, tp_group=kd.tp_group())
    s = student[:, lo:hi].clone().requires_grad_(True)
    loss = sampled_kd_loss(s, draw.ids, draw.weights, draw.teacher_logprobs, temperature=0.8, tp_group=kd.tp_group())
    loss.sum().backward()
    return draw, loss.detach(), s.grad


@pytest.mark.slow  # two spawned processes importing megatron: ~1 min on a loaded 2-core machine
def test_tp2_draws_and_gradients_equal_tp1():
    g = torch.Generator().manual_seed(5)
    teacher = torch.randn(12, V, generator=g) * 3
    student = torch.randn(12, V, generator=g)
    ref = sample_teacher(teacher, samples=16, proposal_temperature=1.3, temperature=0.8, seed=99)
    s = student.clone().requires_grad_(True)
    ref_loss = sampled_kd_loss(s, ref.ids, ref.weights, ref.teacher_logprobs, temperature=0.8)
    ref_loss.sum().backward()
    for rank, (draw, loss, grad) in enumerate(run_on_processes(_tp_worker, 2, args=(teacher, student, 99))):
        assert torch.equal(draw.ids, ref.ids) and torch.equal(draw.counts, ref.counts), f"rank {rank}"
        torch.testing.assert_close(draw.weights, ref.weights)
        torch.testing.assert_close(draw.teacher_logprobs, ref.teacher_logprobs)
        torch.testing.assert_close(loss, ref_loss.detach())
        torch.testing.assert_close(grad, s.grad[:, rank * V // 2:(rank + 1) * V // 2])


@pytest.mark.parametrize("overrides,says", [
    (["loss=sampled", "loss.samples=0"], r"loss.samples=0 is invalid: must be an integer >= 1"),
    (["loss=sampled", "loss.proposal_temperature=0"], r"loss.proposal_temperature=0.0 is invalid: must be a finite "
                                                      r"number > 0"),
    (["loss.proposal_temperature=1.5"], r"loss.proposal_temperature=1.5 is invalid: it is used by sampled KD only"),
    (["loss.normalize_weights=false"], r"loss.normalize_weights=False is invalid: it is used by sampled KD only"),
    (["loss.samples=16"], r"loss.top_k=1024 is invalid with loss.samples=16: .* set loss.top_k=null"),
    (["loss=sampled", "loss.ghost_token=true"], r"loss.ghost_token=True is invalid .* set loss.ghost_token=false"),
    (["loss=sampled", "loss.divergence=reverse_kl"], r"loss.divergence='reverse_kl' is invalid .* forward KL"),
    (["loss=sampled", "loss.top_p=0.9"], r"loss.top_p=0.9 is invalid with loss.samples=64"),
])
def test_bad_sampled_options_are_config_errors(overrides, says):
    from test_config import cfg_of

    from kdexp.config import validate

    with pytest.raises(ValueError, match=says):
        validate(cfg_of(*overrides))


def test_loss_sampled_validates_with_a_proposal_temperature():
    from test_config import cfg_of

    from kdexp.config import validate

    cfg = cfg_of("loss=sampled", "loss.proposal_temperature=1.5", "loss.samples=12")
    validate(cfg)
    assert (cfg.loss.samples, cfg.loss.proposal_temperature, cfg.loss.top_k) == (12, 1.5, None)


def test_importance_weights_by_hand():
    from kdexp.losses.sampled import importance_weights

    counts = torch.tensor([[3, 1, 0]])
    log_ratio = torch.tensor([[1.0, 2.0 ** 0.5, 7.0]]).log()  # p / q = 1, sqrt(2), (unused)
    torch.testing.assert_close(importance_weights(counts), torch.tensor([[0.75, 0.25, 0.0]], dtype=torch.float64))
    total = 3 + 2 ** 0.5
    torch.testing.assert_close(importance_weights(counts, log_ratio),
                               torch.tensor([[3 / total, 2 ** 0.5 / total, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(importance_weights(counts, log_ratio, normalize=False),
                               torch.tensor([[0.75, 2 ** 0.5 / 4, 0.0]], dtype=torch.float64))
