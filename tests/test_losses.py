"""kdexp.losses.logits_kd_loss against an independent float64 reference (tests/_kd_reference.py)."""

import math
import re

import pytest
import torch

import kdexp.losses._sparse as sparse_mod
from _kd_reference import reference_kd
from kdexp.losses import logits_kd_loss

V, N = 60, 7


def _logits(seed, n=N, v=V, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    s = t + torch.randn(n, v, generator=g, dtype=torch.float64) * 1.5  # correlated with the teacher, as after training
    return s.to(dtype), t.to(dtype)


def _compare(kw, *, seed=0, dtype=torch.float32, rtol=1e-5, atol=1e-6, chunk_tokens=None, n=N, v=V, scale=2.0):
    s, t = _logits(seed, n, v, scale, dtype)
    s_ref = s.detach().double().requires_grad_(True)
    ref, ref_stats = reference_kd(s_ref, t, **kw)
    w = torch.linspace(0.5, 1.5, n, dtype=torch.float64)  # a non-uniform upstream gradient
    (ref * w).sum().backward()

    s = s.detach().requires_grad_(True)
    loss, stats = logits_kd_loss(s, t, return_stats=True, chunk_tokens=chunk_tokens, **kw)
    assert loss.shape == (n,) and loss.dtype == torch.float32
    (loss * w.to(loss.dtype)).sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol)
    torch.testing.assert_close(s.grad.double(), s_ref.grad, rtol=rtol, atol=atol)
    for name in ("teacher_kept_mass", "student_kept_mass", "teacher_residual_mass", "student_residual_mass"):
        torch.testing.assert_close(getattr(stats, name).double(), torch.tensor(ref_stats[name], dtype=torch.float64),
                                   rtol=rtol, atol=atol)
    assert stats.nucleus_size.tolist() == ref_stats["nucleus_size"]
    return loss, stats


DIVS = ["forward_kl", "reverse_kl", "jsd"]


@pytest.mark.parametrize("divergence", DIVS)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_dense(divergence, temperature):
    _compare(dict(divergence=divergence, temperature=temperature), chunk_tokens=3)


@pytest.mark.parametrize("divergence", DIVS)
@pytest.mark.parametrize("ghost_token", [True, False])
def test_top_k(divergence, ghost_token):
    _compare(dict(top_k=8, ghost_token=ghost_token, divergence=divergence, temperature=1.7), chunk_tokens=2)


@pytest.mark.parametrize("divergence", DIVS)
def test_top_p_min_k_whole_vocab_nucleus(divergence):
    # teacher scale 1.0: flat enough that nuclei vary between tokens and some hit the min_k floor only with top_p small
    _, st = _compare(dict(top_p=0.6, min_k=3, divergence=divergence), scale=1.0)
    assert len(set(st.nucleus_size.tolist())) > 1
    _, st = _compare(dict(top_p=0.05, min_k=3, divergence=divergence), scale=3.0)
    assert st.nucleus_size.min().item() == 3  # the floor is what keeps these


@pytest.mark.parametrize("ghost_token", [True, False])
def test_top_k_and_top_p(ghost_token):
    _, st = _compare(dict(top_k=10, top_p=0.7, min_k=2, ghost_token=ghost_token), scale=1.5, chunk_tokens=4)
    assert st.nucleus_size.max().item() <= 10


def test_top_p_growing_candidate_search(monkeypatch):
    # With top_k=None the candidate set starts at TOP_P_INITIAL_K and grows x4; start tiny so the growth runs.
    monkeypatch.setattr(sparse_mod, "TOP_P_INITIAL_K", 2)
    _, st = _compare(dict(top_p=0.9, min_k=1, temperature=1.3), scale=1.0, chunk_tokens=3)
    assert st.nucleus_size.max().item() > 8  # needed at least two growth steps


@pytest.mark.parametrize("divergence", DIVS)
def test_renormalize(divergence):
    _compare(dict(top_k=6, normalization="renormalize", ghost_token=False, divergence=divergence, temperature=0.8))
    _compare(dict(top_k=12, top_p=0.5, normalization="renormalize", ghost_token=False, divergence=divergence),
             scale=1.0)


def test_temperature_squared_option():
    _compare(dict(top_k=5, temperature=3.0, scale_by_temperature_squared=True), rtol=5e-5)
    s, t = _logits(1)
    a = logits_kd_loss(s, t, temperature=3.0)
    b = logits_kd_loss(s, t, temperature=3.0, scale_by_temperature_squared=True)
    torch.testing.assert_close(b, 9.0 * a)


@pytest.mark.parametrize("kw", [dict(), dict(top_k=8), dict(top_k=16, top_p=0.8, min_k=2), dict(top_p=0.8)])
def test_bf16_inputs_match_fp32_reference(kw):
    s, _ = _logits(3, dtype=torch.bfloat16)
    # Distinct teacher values in bf16 (spacing 0.1 > bf16's 1/64 below 4): with ties the top-K/nucleus membership
    # at the boundary is arbitrary, in the reference as in any implementation.
    g = torch.Generator().manual_seed(3)
    t = torch.stack([torch.randperm(V, generator=g) for _ in range(N)]).to(torch.float64).mul(0.1).sub(3.0)
    t = t.to(torch.bfloat16)
    assert all(len(set(row.tolist())) == V for row in t)
    s = s.requires_grad_(True)
    s_ref = s.detach().double().requires_grad_(True)
    ref, _ = reference_kd(s_ref, t, **kw)  # the reference sees the same (bf16-rounded) values
    ref.sum().backward()
    loss = logits_kd_loss(s, t, **kw)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert s.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.grad.double(), s_ref.grad, rtol=2e-2, atol=2e-3)  # bf16 gradient storage


@pytest.mark.parametrize("divergence", DIVS)
def test_top_k_equal_vocab_is_dense(divergence):
    s, t = _logits(4)
    s1 = s.clone().requires_grad_(True)
    s2 = s.clone().requires_grad_(True)
    dense = logits_kd_loss(s1, t, divergence=divergence)
    full_k = logits_kd_loss(s2, t, top_k=V, ghost_token=True, divergence=divergence, chunk_tokens=2)
    dense.sum().backward()
    full_k.sum().backward()
    torch.testing.assert_close(full_k, dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2.grad, s1.grad, rtol=1e-5, atol=1e-6)
    # top_p=1.0 is no cut at all
    torch.testing.assert_close(logits_kd_loss(s, t, top_p=1.0, divergence=divergence), dense.detach())


@pytest.mark.parametrize("kw", [
    dict(), dict(divergence="reverse_kl", temperature=1.5), dict(divergence="jsd", beta=0.3),
    dict(top_k=4), dict(top_k=4, ghost_token=False, divergence="reverse_kl"),
    dict(top_k=6, top_p=0.6, min_k=2, divergence="jsd"), dict(top_p=0.7, temperature=0.7),
    dict(top_k=4, normalization="renormalize", ghost_token=False),
])
def test_gradcheck_float64(kw):
    s, t = _logits(5, n=3, v=12, dtype=torch.float64)
    s = s.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: logits_kd_loss(x, t, chunk_tokens=2, **kw), (s,), eps=1e-6,
                                    atol=1e-7)


def test_near_one_kept_mass():
    """Kept mass within 1e-7 of 1 (here ~1e-11 residual): finite, accurate residual and a nonzero gradient."""
    n, v, k = 4, 50, 5
    g = torch.Generator().manual_seed(6)
    t = torch.randn(n, v, generator=g) * 0.1
    t[:, :k] += 30.0
    s = t + torch.randn(n, v, generator=g) * 0.5
    s = s.requires_grad_(True)
    loss, st = logits_kd_loss(s, t, top_k=k, ghost_token=True, return_stats=True)
    s_ref = s.detach().double().requires_grad_(True)
    ref, ref_stats = reference_kd(s_ref, t, top_k=k)
    ref.sum().backward()
    loss.sum().backward()
    true_ghost = torch.tensor(ref_stats["teacher_residual_mass"], dtype=torch.float64)
    assert bool((1 - torch.tensor(ref_stats["teacher_kept_mass"], dtype=torch.float64) < 1e-7).all())
    assert bool((true_ghost > 0).all())
    torch.testing.assert_close(st.teacher_residual_mass.double(), true_ghost, rtol=1e-4, atol=0)  # relative accuracy
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-4, atol=1e-9)
    assert torch.isfinite(s.grad).all()
    outside = s.grad[:, k:].double()
    assert bool((outside != 0).any())  # the ghost keeps a gradient on the non-kept logits
    torch.testing.assert_close(outside, s_ref.grad[:, k:], rtol=1e-3, atol=1e-14)
    torch.testing.assert_close(s.grad.double(), s_ref.grad, rtol=1e-4, atol=1e-9)


def test_teacher_gets_no_gradient():
    s, t = _logits(7)
    s.requires_grad_(True)
    t.requires_grad_(True)
    for kw in (dict(), dict(top_k=5), dict(top_p=0.5)):
        logits_kd_loss(s, t, **kw).sum().backward()
    assert t.grad is None and s.grad is not None


def test_shape_and_stats_of_batched_input():
    s, t = _logits(8, n=6)
    loss, st = logits_kd_loss(s.view(2, 3, V), t.view(2, 3, V), top_k=7, return_stats=True)
    assert loss.shape == (2, 3)
    assert st.nucleus_size.shape == (2, 3) and st.nucleus_size.dtype == torch.int64
    assert bool((st.nucleus_size == 7).all())
    torch.testing.assert_close(st.teacher_kept_mass + st.teacher_residual_mass, torch.ones(2, 3))
    p = torch.softmax(t.double(), -1).sort(-1, descending=True).values[:, :7].sum(-1)
    torch.testing.assert_close(st.teacher_kept_mass.double().flatten(), p, rtol=1e-6, atol=1e-7)
    _, st = logits_kd_loss(s, t, return_stats=True)
    assert bool((st.nucleus_size == V).all()) and bool((st.teacher_kept_mass == 1).all())


@pytest.mark.parametrize("kw, match", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.1), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=V + 1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_k=4, min_k=5), "min_k"), (dict(min_k=0), "min_k"), (dict(top_p=0.5, min_k=V + 1), "min_k"),
    (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(divergence="kl"), "divergence"), (dict(normalization="softmax"), "normalization"),
    (dict(top_k=4, normalization="renormalize"), "ghost_token"),
    (dict(divergence="jsd", beta=1.0), "beta"), (dict(chunk_tokens=0), "chunk_tokens"),
])
def test_bad_arguments(kw, match):
    s, t = _logits(9)
    with pytest.raises(ValueError, match=match):
        logits_kd_loss(s, t, **kw)


def test_bad_shapes_name_both_sizes():
    s, t = _logits(10)
    with pytest.raises(ValueError, match=r"vocabulary.*60.*59"):
        logits_kd_loss(s, t[:, :59])
    with pytest.raises(ValueError, match=r"shape mismatch.*\(7, 60\).*\(6, 60\)"):
        logits_kd_loss(s, t[:6])


def test_default_chunking_matches_single_chunk():
    s, t = _logits(11, n=40, v=300)
    for kw in (dict(), dict(top_k=20, top_p=0.9)):
        a = logits_kd_loss(s, t, chunk_tokens=1, **kw)
        b = logits_kd_loss(s, t, **kw)
        torch.testing.assert_close(a, b)
    assert math.isfinite(float(b.sum()))


# ---------------------------------------------------------------------------------------------------------------------
# Near convergence (student = teacher + noise ~1e-3) with large logits: the loss is ~1e-6 and float32 log-probs formed
# from uncentred logits are ~ulp(256) = 3e-5 off. Every option set against float64, at offsets 0, 64 and 256.
NEAR = {
    "dense": dict(), "dense_reverse_kl": dict(divergence="reverse_kl"), "dense_jsd": dict(divergence="jsd", beta=0.3),
    "top_k": dict(top_k=8), "top_k_no_ghost": dict(top_k=8, ghost_token=False),
    "top_p_min_k": dict(top_p=0.6, min_k=3), "top_k_top_p": dict(top_k=10, top_p=0.7, min_k=2),
    "renormalize": dict(top_k=8, normalization="renormalize", ghost_token=False),
    "renormalize_top_p": dict(top_k=12, top_p=0.5, normalization="renormalize", ghost_token=False),
    "top_k_reverse_kl": dict(top_k=8, divergence="reverse_kl"), "top_k_jsd": dict(top_k=8, divergence="jsd"),
    "top_p_jsd": dict(top_p=0.8, min_k=2, divergence="jsd"),
}


def near_converged(seed, offset, n=16, v=V, noise=1e-3):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, v, generator=g, dtype=torch.float64) * 2.0 + offset
    s = t + torch.randn(n, v, generator=g, dtype=torch.float64) * noise
    return s.float(), t.float()


@pytest.mark.parametrize("offset", [0.0, 64.0, 256.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0, 3.0])  # 3: a division by T that is not exact
@pytest.mark.parametrize("name", sorted(NEAR))
def test_near_converged_large_logits_match_float64(name, temperature, offset):
    kw = dict(NEAR[name], temperature=temperature)
    s, t = near_converged(12, offset)
    s_ref = s.double().requires_grad_(True)
    ref, _ = reference_kd(s_ref, t, **kw)  # the same float32 inputs, exactly, in float64
    ref.sum().backward()
    x = s.clone().requires_grad_(True)
    loss = logits_kd_loss(x, t, chunk_tokens=5, **kw)
    loss.sum().backward()
    ref = ref.detach()
    assert float(ref.abs().max()) < 1e-3  # near convergence indeed (the top_k_no_ghost value is not a divergence)
    err = float((loss.detach().double() - ref).abs().max())
    assert err <= 1e-6, f"|loss - float64| = {err:.2e}"
    # never below zero beyond rounding where the exact value is a divergence >= 0
    nonneg = ref >= 0  # all tokens but some of top_k_no_ghost's, whose kept sub-distributions can give < 0
    assert bool((loss.detach()[nonneg] >= -1e-7).all()), float(loss.min())
    scale = float(s_ref.grad.abs().max())
    gerr = float((x.grad.double() - s_ref.grad).abs().max())
    assert gerr <= 4e-3 * scale, f"gradient error {gerr:.2e} vs scale {scale:.2e}"


def test_issue_example_renormalized_top_k():
    """The issue's token: float64 1.6e-7, uncentred float32 gave 2.7e-5."""
    t = torch.tensor([[256.0, 255.0, 254.0, 0.0]])
    s = t + torch.tensor([[0.0, 0.001, -0.001, 0.0]])
    kw = dict(top_k=3, normalization="renormalize", ghost_token=False)
    ref, _ = reference_kd(s, t, **kw)
    assert float(ref) == pytest.approx(1.576e-7, rel=1e-3)
    assert abs(float(logits_kd_loss(s, t, **kw)) - float(ref)) < 1e-7


# ---------------------------------------------------------------------------------------------------------------------
# One contract: the loss options are logits_kd_loss's keywords, with its defaults and its rules.
RUNTIME_KEYWORDS = ("tp_group", "return_stats", "chunk_tokens", "labels")  # per call, not loss options


def test_options_are_the_keywords_of_logits_kd_loss():
    import inspect

    from kdexp.config import LossConfig
    from kdexp.losses import KDLossOptions

    params = {p.name: p.default for p in inspect.signature(logits_kd_loss).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in RUNTIME_KEYWORDS}
    assert params == {f: getattr(KDLossOptions(), f) for f in KDLossOptions.names()}
    from kdexp.losses import cached_kd_loss

    # the cached-teacher twin takes the same option keywords with the same defaults (kdexp.losses.cached)
    cached = {p.name: p.default for p in inspect.signature(cached_kd_loss).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in RUNTIME_KEYWORDS}
    assert cached == params
    from dataclasses import fields

    from kdexp.losses.options import SampledKDOptions

    # the loss group = the loss keywords + the sampled-KD keys + the hidden-state pairs + the option's name + how the
    # objective forms the logits (fused_head), nothing else
    assert sorted(f.name for f in fields(LossConfig)) == sorted(
        [*KDLossOptions.names(), *(f.name for f in fields(SampledKDOptions)), "intermediate", "name", "fused_head"])
    assert KDLossOptions.from_config(LossConfig()).kwargs() == {**params, "top_k": 1024}  # the run's default: Top-K


@pytest.mark.parametrize("kw, key", [(dict(temperature=math.inf), "temperature"), (dict(top_k=8, min_k=9), "min_k"),
                                     (dict(divergence="tv"), "divergence"), (dict(beta=0.0), "beta"),
                                     (dict(top_k=4, normalization="renormalize"), "ghost_token")])
def test_logits_kd_loss_raises_the_options_own_message(kw, key):
    from kdexp.losses import KDLossOptions

    with pytest.raises(ValueError) as expected:
        KDLossOptions(**kw).check()
    s, t = _logits(13)
    with pytest.raises(ValueError) as got:
        logits_kd_loss(s, t, **kw)
    assert str(got.value) == str(expected.value)
    assert str(expected.value).startswith(f"{key}=")  # the message names the key
    with pytest.raises(ValueError, match=rf"^loss\.{re.escape(key)}="):  # the config's message: the same rule
        KDLossOptions(**kw).check(prefix="loss.")


_HELD_CASES = [dict(top_k=24), dict(top_k=24, temperature=2.0), dict(top_k=24, ghost_token=False),
               dict(top_k=24, divergence="jsd", beta=0.3), dict(top_k=V),
               dict(top_k=24, normalization="renormalize", ghost_token=False)]


# the fused LM loss is at temperature 1: the T = 2 case runs without it only
@pytest.mark.parametrize("kw,fused_lm", [(kw, False) for kw in _HELD_CASES] +
                         [(kw, True) for kw in _HELD_CASES if kw.get("temperature", 1.0) == 1.0],
                         ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else f"lm={v}")
def test_held_student_exps_give_the_recomputed_gradient(kw, fused_lm):
    """Top-K in float32 without TP keeps the student's exps outside S from the forward in the gradient's own rows and
    scales them in place in the backward. A second backward (retain_graph) finds them consumed and recomputes them
    as every other path does: both gradients agree to float32 rounding, and the first matches float64 (the held path
    is what the float64 reference tests of this file check; this pins it against the recomputation). top_k=V leaves
    nothing outside S; chunk_tokens=5 splits the 7 rows into chunks, the last shorter."""
    s, t = _logits(11)
    s = s.float().requires_grad_()
    labels = torch.randint(0, V, s.shape[:-1], generator=torch.Generator().manual_seed(3)) if fused_lm else None
    out = logits_kd_loss(s, t.float(), chunk_tokens=5, labels=labels, **kw)
    total = sum(o.sum() for o in out) if fused_lm else out.sum()
    (held,) = torch.autograd.grad(total, s, retain_graph=True)
    (recomputed,) = torch.autograd.grad(total, s)
    assert held.abs().max() > 0
    torch.testing.assert_close(held, recomputed, rtol=1e-5, atol=1e-7)
    s64 = s.detach().double().requires_grad_()
    out64 = logits_kd_loss(s64, t.double(), chunk_tokens=5, labels=labels, **kw)
    (sum(o.sum() for o in out64) if fused_lm else out64.sum()).backward()
    torch.testing.assert_close(held.double(), s64.grad, rtol=1e-4, atol=1e-6)
