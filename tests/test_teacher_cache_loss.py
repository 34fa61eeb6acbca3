"""kdexp.losses.cached: the KD loss from a cached top-K_max record equals the online logits_kd_loss on the same
tensors (loss, gradient, stats within 1e-5 relative), stays accurate near a kept mass of 1 (against float64), and
refuses what a top-K_max cache cannot serve; TP=2 over gloo against the unsharded online loss."""

import pytest
import torch
import torch.distributed as dist

from _kd_reference import reference_kd
from kdexp.distributed.testing import run_on_processes
from kdexp.losses import cached_kd_loss, logits_kd_loss, teacher_topk_record

V, N, K_MAX = 64, 9, 24
TEMPS = [1.0, 2.0, 0.7]

CASES = [
    dict(top_k=7),
    dict(top_k=K_MAX),
    dict(top_k=10, ghost_token=False),
    dict(top_k=12, divergence="reverse_kl", temperature=2.0),
    dict(top_k=K_MAX, top_p=0.8, min_k=2),
    dict(top_k=16, top_p=0.6, min_k=3, divergence="reverse_kl", temperature=0.7, ghost_token=False),
    dict(top_k=9, divergence="jsd", beta=0.3, temperature=2.0),
    dict(top_k=6, normalization="renormalize", ghost_token=False),
    dict(top_k=8, temperature=2.0, scale_by_temperature_squared=True),
]


def _logits(seed, n=N, v=V):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, v, generator=g) * 2.5
    return t + torch.randn(n, v, generator=g) * 1.5, t


def _cached(s, rec, kw, **extra):
    j = TEMPS.index(kw.get("temperature", 1.0))
    return cached_kd_loss(s, rec.values, rec.indices, rec.lse[..., j], rec.lse_rest[..., j], return_stats=True,
                          **kw, **extra)


def _both(s, t, rec, kw, w):
    a, b = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    l1, st1 = logits_kd_loss(a, t, return_stats=True, **kw)
    (l1 * w).sum().backward()
    l2, st2 = _cached(b, rec, kw, chunk_tokens=4)
    (l2 * w).sum().backward()
    return (l1, st1, a.grad), (l2, st2, b.grad)


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_cached_equals_online(kw):
    s, t = _logits(1)
    rec = teacher_topk_record(t, K_MAX, TEMPS)
    w = torch.linspace(0.5, 1.5, N)
    (l1, st1, g1), (l2, st2, g2) = _both(s, t, rec, kw, w)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-7)
    for name, x, y in zip(st1._fields, st2, st1):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # and against the float64 reference directly (not only through the online loss)
    ref, _ = reference_kd(s.double(), t, **kw)
    torch.testing.assert_close(l2.double(), ref, rtol=1e-5, atol=1e-6)


def test_record_is_centred_sorted_and_exact():
    s, t = _logits(2)
    rec = teacher_topk_record(t.double(), K_MAX, TEMPS)
    order = torch.argsort(t.double(), 1, descending=True)[:, :K_MAX]
    assert torch.equal(rec.indices, order)
    assert bool((rec.values[:, 0] == 0).all()) and bool((rec.values.diff(dim=1) <= 0).all())
    for j, temp in enumerate(TEMPS):
        x = t.double() / temp
        torch.testing.assert_close(rec.lse[:, j], torch.logsumexp(x - x.amax(1, keepdim=True), 1), rtol=1e-12, atol=0)
        rest = x.scatter(1, order, float("-inf"))
        torch.testing.assert_close(rec.lse_rest[:, j], torch.logsumexp(rest - x.amax(1, keepdim=True), 1),
                                   rtol=1e-12, atol=0)


def test_near_one_kept_mass_uses_the_stored_complement():
    """Kept mass within 1e-7 of 1 (residual ~1e-11): the cached ghost residual and gradient match float64, where
    1 - sum(exp(kept)) in float32 is 0 (Megatron-LM's cached loss clamps it to 1e-8: off by nats)."""
    n, v, k = 4, 50, 5
    g = torch.Generator().manual_seed(6)
    t = torch.randn(n, v, generator=g) * 0.1
    t[:, :k] += 30.0
    s = (t + torch.randn(n, v, generator=g) * 0.5).requires_grad_(True)
    rec = teacher_topk_record(t, 8, [1.0])
    loss, st = cached_kd_loss(s, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], top_k=k,
                              return_stats=True)
    loss.sum().backward()
    s_ref = s.detach().double().requires_grad_(True)
    ref, ref_stats = reference_kd(s_ref, t, top_k=k)
    ref.sum().backward()
    true_ghost = torch.tensor(ref_stats["teacher_residual_mass"], dtype=torch.float64)
    assert bool((1 - torch.tensor(ref_stats["teacher_kept_mass"], dtype=torch.float64) < 1e-7).all())
    kept = (rec.values[:, :k] - rec.lse[:, :1]).exp().sum(1)
    naive = (1 - kept).double()  # float32 rounding of ~1e-7 against a true residual of ~1e-11: no digit left
    assert bool(((naive - true_ghost).abs() > 0.5 * true_ghost).all())  # off by 50% or (mostly) by 1e5x
    torch.testing.assert_close(st.teacher_residual_mass.double(), true_ghost, rtol=1e-4, atol=0)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-4, atol=1e-9)
    assert bool((s.grad[:, k:] != 0).any())
    torch.testing.assert_close(s.grad.double(), s_ref.grad, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_compact_values_stay_close(dtype, rtol):
    """A bf16/fp16 copy of the centred values (the compact cache) gives the loss to about the format's precision."""
    s, t = _logits(3)
    rec = teacher_topk_record(t, K_MAX, [1.0])
    exact = cached_kd_loss(s, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], top_k=K_MAX)
    compact = cached_kd_loss(s, rec.values.to(dtype), rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], top_k=K_MAX)
    torch.testing.assert_close(compact, exact, rtol=rtol, atol=1e-3)


def test_refuses_what_the_cache_cannot_serve():
    s, t = _logits(4)
    rec = teacher_topk_record(t, 8, [1.0])
    args = (s, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0])
    with pytest.raises(ValueError, match=r"top_k=9 is invalid: must be in \[1, the cached K_max=8\]"):
        cached_kd_loss(*args, top_k=9)
    with pytest.raises(ValueError, match="dense KD cannot be served"):
        cached_kd_loss(*args, top_k=None)
    with pytest.raises(ValueError, match="dense KD cannot be served"):
        cached_kd_loss(*args, top_k=None, top_p=1.0)
    with pytest.raises(ValueError, match=r"min_k=9 is invalid: must be in \[1, the cached K_max=8\]"):
        cached_kd_loss(*args, top_k=None, top_p=0.5, min_k=9)
    with pytest.raises(ValueError, match=r"lse has shape \(3,\), expected \(9,\)"):
        cached_kd_loss(s, rec.values, rec.indices, rec.lse[:3, 0], rec.lse_rest[:, 0], top_k=4)
    with pytest.raises(ValueError, match="k_max=65 is invalid"):
        teacher_topk_record(t, 65, [1.0])


# ------------------------------------------------------------------------------------------------ TP=2 (gloo)

def _tp_worker(rank, world):
    dist.init_process_group("gloo")
    s, t = _logits(5)
    lo, hi = (0, 40) if rank == 0 else (40, V)  # uneven shards; top-K_max wider than one shard's best
    rec1 = teacher_topk_record(t, K_MAX, TEMPS)
    rec2 = teacher_topk_record(t[:, lo:hi].contiguous(), K_MAX, TEMPS, tp_group=dist.group.WORLD, chunk_tokens=4)
    for a, b in zip(rec1, rec2):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    w = torch.linspace(0.5, 1.5, N)
    for kw in CASES:
        full = s.clone().requires_grad_(True)
        ref, ref_stats = logits_kd_loss(full, t, return_stats=True, **kw)  # online, unsharded
        (ref * w).sum().backward()
        shard = s[:, lo:hi].clone().requires_grad_(True)
        loss, stats = _cached(shard, rec2, kw, tp_group=dist.group.WORLD, chunk_tokens=4)
        (loss * w).sum().backward()
        where = f"{kw} rank {rank}"
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} loss: {m}")
        torch.testing.assert_close(shard.grad, full.grad[:, lo:hi], rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{where} grad: {m}")
        for x, y in zip(stats, ref_stats):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} stats: {m}")
    return len(CASES)


def test_tp2_cached_equals_unsharded_online():
    assert run_on_processes(_tp_worker, 2, timeout=240) == [len(CASES)] * 2


# ------------------------------------------------------------------------------------- a nucleus from the cache

NUCLEI = [dict(top_p=0.8), dict(top_p=0.95, min_k=3), dict(top_p=0.6, divergence="reverse_kl", temperature=2.0),
          dict(top_p=0.9, ghost_token=False, divergence="jsd", temperature=0.7),
          dict(top_p=0.7, normalization="renormalize", ghost_token=False)]


@pytest.mark.parametrize("kw", NUCLEI, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_a_nucleus_that_fits_is_served_as_online(kw):
    s, t = _logits(7, n=30)
    t = t * 2  # peaked enough that each token's nucleus fits in K_MAX of V
    rec = teacher_topk_record(t, K_MAX, TEMPS)
    w = torch.linspace(0.5, 1.5, 30)
    (l1, st1, g1), (l2, st2, g2) = _both(s, t, rec, kw, w)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-7)
    assert torch.equal(st1.nucleus_size, st2.nucleus_size)
    assert int(st2.nucleus_size.max()) < K_MAX  # not a Top-K_max in disguise
    ref = reference_kd(s.double(), t.double(), **kw)[0]
    torch.testing.assert_close(l2.double(), ref, rtol=1e-5, atol=1e-6)


def test_a_nucleus_that_overflows_names_the_tokens_and_a_k_max():
    s, t = _logits(8, n=12)
    rec = teacher_topk_record(t, 4, [1.0])
    mass = 1 - (rec.lse_rest[:, 0] - rec.lse[:, 0]).double().exp()
    over = int((mass < 0.9).sum())
    assert 0 < over < 12
    with pytest.raises(ValueError, match=rf"top_p=0.9 does not fit in the cached top-4 for {over} of 12 tokens.*"
                                         r"teacher.k_max >= \d+ \(a lower bound\)") as err:
        cached_kd_loss(s, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], top_p=0.9)
    need = int(str(err.value).split("teacher.k_max >= ")[1].split()[0])
    # the bound is honest: the nucleus of the worst token is at least that large
    _, stats = logits_kd_loss(s, t, top_p=0.9, return_stats=True)
    assert 4 < need <= int(stats.nucleus_size.max())
