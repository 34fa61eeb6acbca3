"""The losses at their edges, each against the float64 reference (tests/_kd_reference.py) or a hand value:
ids changed after the forward (the CPU kernel's backward), tied teacher logits (one tie rule for the online and the
cached selection), sampled KD at logits ~300 (centred), zero tokens, a teacher with -inf logits (a masked or padded
vocabulary: 0 log 0 = 0), non-finite options, and the JSD's clamp at 0."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _kd_reference import reference_kd
from kdexp.losses import (_native, cached_kd_loss, draw_teacher, logits_kd_loss, sample_teacher, sampled_kd_loss,
                          teacher_topk_record)


def _logits(n=6, v=40, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale, torch.randn(n, v, generator=g) * scale


# -- the kernel's backward reads ids the caller owns ------------------------------------------------------------------

def test_cached_ids_changed_after_the_forward_are_refused_not_read():
    assert _native.kernel() is not None
    student, teacher = _logits()
    rec = teacher_topk_record(teacher, 8, [1.0])
    s = student.clone().requires_grad_(True)
    idx = rec.indices.clone()
    loss = cached_kd_loss(s, rec.values, idx, rec.lse[:, 0], rec.lse_rest[:, 0], top_k=8)
    idx[1, 3] = 10**9  # in place: autograd's version counter of the saved ids
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()
    # written behind autograd's back (.data, no version bump): the kernel checks the ids itself
    s = student.clone().requires_grad_(True)
    idx = rec.indices.clone()
    loss = cached_kd_loss(s, rec.values, idx, rec.lse[:, 0], rec.lse_rest[:, 0], top_k=8)
    idx.data[1, 3] = 10**9
    with pytest.raises(IndexError, match="row 1"):
        loss.sum().backward()


def test_the_kernel_entry_points_check_every_id_and_shape():
    z = torch.randn(3, 10)
    ids = torch.tensor([[0, 1], [2, 10], [3, 4]])
    with pytest.raises(IndexError, match="row 1"):
        _native.sampled_forward(z, ids, 1.0)
    c, lse = torch.zeros(3), torch.zeros(3)
    with pytest.raises(IndexError, match="row 1"):
        _native.sampled_backward(z, 1.0, c, lse, torch.ones(3), ids, torch.zeros(3, 2))
    with pytest.raises(IndexError, match="row 1"):
        _native.topk_backward_(torch.zeros(3, 10), ids - 1 + 1, torch.zeros(3, 2), torch.zeros(3, 2), c, c, c)
    with pytest.raises(IndexError, match="row 0"):
        _native.topk_forward(z, torch.tensor([[-1, 1], [2, 3], [3, 4]]), 1.0, torch.empty(3, 10))
    for bad in (lambda: _native.topk_forward(z, ids[:2], 1.0, torch.empty(3, 10)),  # rows disagree
                lambda: _native.topk_forward(z, ids, 1.0, torch.empty(3, 10).expand(3, 10)[:, :9]),
                lambda: _native.topk_forward(z, ids.int(), 1.0, torch.empty(3, 10)),
                lambda: _native.topk_forward(z, ids, math.inf, torch.empty(3, 10)),
                lambda: _native.topk_backward_(torch.zeros(3, 10), ids.clamp(max=9), torch.zeros(2, 2),
                                               torch.zeros(3, 2), c, c, c),
                lambda: _native.sampled_forward(z.t(), ids, 1.0),  # column stride 3
                lambda: _native.sampled_backward(z, 1.0, c[:2], lse, c, ids.clamp(max=9), torch.zeros(3, 2))):
        with pytest.raises(ValueError, match="native kernel"):
            bad()


# -- one tie rule: the lower vocabulary id wins -------------------------------------------------------------------------

TIES = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, -1.0],
                     [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
                     [3.0, 3.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0]])
STUDENT = torch.tensor([[0.3, -1.0, 2.0, 0.1, 0.7, -0.2, 1.5, 0.0],
                        [1.0, 0.0, -1.0, 2.0, 0.5, -0.5, 0.2, 0.9],
                        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]])


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_k=2, divergence="reverse_kl"),
                                dict(top_k=6, top_p=0.55), dict(top_k=8, top_p=0.7, min_k=2),
                                dict(top_k=3, ghost_token=False, normalization="renormalize")],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_tied_teacher_logits_keep_the_same_entries_online_and_cached(kw):
    for k_max in (kw["top_k"], 8):  # the cache's K_max at the tie and beyond it
        rec = teacher_topk_record(TIES, k_max, [1.0])
        a, b = STUDENT.clone().requires_grad_(True), STUDENT.clone().requires_grad_(True)
        online = logits_kd_loss(a, TIES, **kw)
        cached = cached_kd_loss(b, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], **kw)
        ref = reference_kd(STUDENT.double(), TIES.double(), **kw)[0]  # a stable sort: lower ids first
        torch.testing.assert_close(online.double(), ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(cached.double(), ref, rtol=0, atol=1e-6)
        online.sum().backward()
        cached.sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


def test_the_cache_record_orders_ties_by_id():
    rec = teacher_topk_record(TIES, 5, [1.0])
    assert rec.indices[0].tolist() == [0, 1, 2, 3, 4]
    assert rec.indices[1].tolist() == [0, 1, 2, 3, 4]
    assert rec.indices[2].tolist() == [0, 1, 6, 7, 3]


# -- sampled KD is centred ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_kd_is_exact_at_logits_near_300(native, temperature, monkeypatch):
    if not native:
        monkeypatch.setitem(_native._state, "lib", None)
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(16, 200, generator=g) * 2 + 300
    student = teacher + 1e-3 * torch.randn(teacher.shape, generator=g)
    smp = sample_teacher(teacher, samples=32, temperature=temperature, proposal_temperature=temperature, seed=1)
    s = student.clone().requires_grad_(True)
    got = sampled_kd_loss(s, smp.ids, smp.weights, smp.teacher_logprobs, temperature=temperature)
    got.sum().backward()
    s64 = student.double().requires_grad_(True)
    log_s = torch.log_softmax(s64 / temperature, -1).gather(1, smp.ids)
    ref = (smp.weights.double() * (smp.teacher_logprobs.double() - log_s)).sum(1)
    ref.sum().backward()
    assert (got.double() - ref).abs().max().item() < 2e-6  # uncentred: 1.6e-5
    assert (s.grad.double() - s64.grad).abs().max().item() < 1e-6


# -- zero tokens --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, dict(top_k=4), dict(top_p=0.9), dict(top_k=4, labels=True)],
                         ids=["dense", "top_k", "top_p", "top_k_lm"])
def test_zero_tokens_give_an_empty_loss_and_gradient(kw):
    kw = dict(kw)
    labels = torch.zeros(2, 0, dtype=torch.long) if kw.pop("labels", False) else None
    s = torch.zeros(2, 0, 16, requires_grad=True)
    out = logits_kd_loss(s, torch.zeros(2, 0, 16), labels=labels, **kw)
    for t in out if isinstance(out, tuple) else (out,):
        assert t.shape == (2, 0) and t.sum().item() == 0.0
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert s.grad.shape == s.shape
    rec = teacher_topk_record(torch.zeros(0, 16), 4, [1.0])
    s = torch.zeros(0, 16, requires_grad=True)
    cached_kd_loss(s, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], top_k=4).sum().backward()
    smp = sample_teacher(torch.zeros(0, 16), samples=3)
    loss = sampled_kd_loss(s, smp.ids, smp.weights, smp.teacher_logprobs)
    assert loss.shape == (0,)
    loss.sum().backward()


# -- a teacher with -inf logits -----------------------------------------------------------------------------------------

MASKED = [dict(), dict(top_k=8), dict(top_k=30), dict(top_p=0.95), dict(top_k=30, top_p=0.9, min_k=2),
          dict(divergence="jsd", beta=0.4), dict(top_k=30, divergence="jsd"), dict(top_k=30, ghost_token=False),
          dict(temperature=2.0, top_k=12)]


@pytest.mark.parametrize("kw", MASKED, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "dense")
@pytest.mark.parametrize("native", [True, False])
def test_a_teacher_with_minus_inf_logits_is_exact(kw, native, monkeypatch):
    if not native:
        monkeypatch.setitem(_native._state, "lib", None)
    student, teacher = _logits(n=5, v=40, seed=2)
    teacher[:, 24:] = -math.inf  # padded rows of the teacher's vocabulary
    teacher[3, :14] = -math.inf  # a row with 10 live entries (fewer than top_k=12 or 30)
    s = student.clone().requires_grad_(True)
    loss, stats = logits_kd_loss(s, teacher, return_stats=True, **kw)
    s64 = student.double().requires_grad_(True)
    ref, ref_stats = reference_kd(s64, teacher.double(), **kw)
    assert torch.isfinite(loss).all() and torch.isfinite(ref).all()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.teacher_residual_mass.double(),
                               torch.tensor(ref_stats["teacher_residual_mass"], dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)
    if "top_k" in kw and not kw.get("top_p"):
        rec = teacher_topk_record(teacher, 30, [kw.get("temperature", 1.0)])
        cached = cached_kd_loss(student, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], **kw)
        torch.testing.assert_close(cached.double(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_reverse_kl_against_an_empty_teacher_entry_is_infinite():
    student, teacher = _logits(n=3, v=20)
    teacher[:, 15:] = -math.inf
    for kw in (dict(divergence="reverse_kl"), dict(top_k=15, divergence="reverse_kl")):  # S: every live entry
        loss = logits_kd_loss(student, teacher, **kw)
        ref = reference_kd(student.double(), teacher.double(), **kw)[0]
        assert torch.isinf(ref).all() and torch.isinf(loss).all() and (loss > 0).all()
    # masked on both sides (a padded vocabulary, aligned): every divergence is finite and exact
    student[:, 15:] = -math.inf
    for div in ("forward_kl", "reverse_kl", "jsd"):
        for kw in (dict(), dict(top_k=10), dict(top_k=18)):
            s = student.clone().requires_grad_(True)
            loss = logits_kd_loss(s, teacher, divergence=div, **kw)
            ref = reference_kd(student.double(), teacher.double(), divergence=div, **kw)[0]
            torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
            loss.sum().backward()
            assert torch.isfinite(s.grad).all() and (s.grad[:, 15:] == 0).all()


def test_sampled_kd_with_a_masked_teacher_never_draws_a_masked_id():
    student, teacher = _logits(n=8, v=30)
    teacher[:, 20:] = -math.inf
    smp = sample_teacher(teacher, samples=64, seed=0)
    used = smp.counts > 0
    assert (smp.ids[used] < 20).all()
    loss = sampled_kd_loss(student, smp.ids, smp.weights, smp.teacher_logprobs)
    assert torch.isfinite(loss).all()


# -- options ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0.0, -1.0])
def test_every_non_finite_or_out_of_range_temperature_is_a_value_error(bad):
    student, teacher = _logits(n=2, v=10)
    ids = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        sampled_kd_loss(student, ids, torch.ones(2, 1), temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        draw_teacher(teacher, samples=2, proposal_temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        draw_teacher(teacher, samples=2, temperatures=(bad,))
    with pytest.raises(ValueError, match="temperature"):
        logits_kd_loss(student, teacher, temperature=bad)
    with pytest.raises(ValueError, match="temperatures"):
        teacher_topk_record(teacher, 3, [bad])


@pytest.mark.parametrize("kw", [dict(top_p=math.nan), dict(top_p=math.inf), dict(beta=math.nan, divergence="jsd"),
                                dict(top_k=0), dict(top_k=11), dict(top_k=2.5), dict(min_k=0), dict(chunk_tokens=0)])
def test_bad_loss_options_are_value_errors(kw):
    student, teacher = _logits(n=2, v=10)
    with pytest.raises(ValueError):
        logits_kd_loss(student, teacher, **kw)


def test_jsd_is_clamped_at_zero_on_any_kept_set():
    # JSD is >= 0 bucket by bucket (log-sum inequality), with or without the ghost bucket: never negative here
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 300, generator=g) * 3 + 256
    student = teacher + 1e-4 * torch.randn(teacher.shape, generator=g)
    for kw in (dict(top_k=16, ghost_token=False), dict(top_k=16, top_p=0.5, ghost_token=False), {}):
        loss = logits_kd_loss(student, teacher, divergence="jsd", **kw)
        assert loss.min().item() >= 0.0


def test_global_topk_follows_the_tie_rule_on_many_ties():
    from kdexp.losses._shard import Shard
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (200, 17), generator=g).float()  # every row full of ties
    shard = Shard.make(17, None, x.device)
    for k in (1, 3, 8, 16, 17):
        order = torch.argsort(x, dim=1, descending=True, stable=True)[:, :k]
        vals, idx = shard.global_topk(x, k, torch.float32, sort=True)
        assert torch.equal(idx, order) and torch.equal(vals, x.gather(1, order))
        vals, idx = shard.global_topk(x, k, torch.float32, sort=False)
        assert torch.equal(idx.sort(1).values, order.sort(1).values)


def test_the_sorted_winners_follow_the_tie_rule_in_rows_with_and_without_ties():
    """global_topk sorts its winners with one sort by value and re-orders only rows holding equal values (or NaNs)
    by the rule: mixed rows (distinct, tied, -inf padded, NaN) against the rule's definition, a sort by (value
    descending, id ascending)."""
    from kdexp.losses._shard import _sorted
    g = torch.Generator().manual_seed(3)
    vals = torch.randn(64, 40, generator=g, dtype=torch.float64)
    vals[8:16] = torch.randint(0, 3, (8, 40), generator=g).double()  # full of ties
    vals[16:24, 30:] = -math.inf  # padded vocabulary
    vals[24:28, ::7] = math.nan
    vals[28:32] = vals[28:32].to(torch.bfloat16).double()  # some equal after rounding
    ids = torch.stack([torch.randperm(400, generator=g)[:40] for _ in range(64)])
    by_id = ids.argsort(dim=1)
    ref = by_id.gather(1, vals.gather(1, by_id).argsort(dim=1, descending=True, stable=True))
    got_vals, got_ids = _sorted(vals.clone(), ids.clone())
    assert torch.equal(got_ids, ids.gather(1, ref))
    assert torch.equal(got_vals.nan_to_num(7.0), vals.gather(1, ref).nan_to_num(7.0))


@given(data=st.data(), rows=st.integers(0, 4), width=st.integers(0, 12))
@settings(max_examples=300, deadline=None)
def test_the_sorted_winners_follow_the_tie_rule_on_any_values(data, rows, width):
    """Property: for any values (drawn from a small set, so ties are common, with +-inf and NaN) and distinct ids,
    _sorted gives the order of the rule's definition."""
    from kdexp.losses._shard import _sorted
    pool = st.sampled_from([0.0, 1.0, -1.0, 2.5, math.inf, -math.inf, math.nan])
    vals = torch.tensor([[data.draw(pool) for _ in range(width)] for _ in range(rows)],
                        dtype=torch.float32).reshape(rows, width)
    ids = torch.tensor([data.draw(st.permutations(range(50)))[:width] for _ in range(rows)],
                       dtype=torch.int64).reshape(rows, width)
    by_id = ids.argsort(dim=1)
    ref = by_id.gather(1, vals.gather(1, by_id).argsort(dim=1, descending=True, stable=True))
    got_vals, got_ids = _sorted(vals.clone(), ids.clone())
    assert torch.equal(got_ids, ids.gather(1, ref))
    assert torch.equal(got_vals.nan_to_num(7.0), vals.gather(1, ref).nan_to_num(7.0))


def _tp_tie_worker(rank, world):
    import torch.distributed as dist

    from kdexp.losses._shard import Shard

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(4)
    t = torch.randint(0, 3, (30, 21), generator=g).float()  # ties everywhere, across the shard boundary
    s = torch.randn(30, 21, generator=g)
    lo, hi = (0, 9) if rank == 0 else (9, 21)  # uneven shards
    shard = Shard.make(hi - lo, dist.group.WORLD, t.device)
    for k in (1, 5, 9, 12, 20):
        _, idx = shard.global_topk(t[:, lo:hi].contiguous(), k, torch.float32, sort=True)
        assert torch.equal(idx, torch.argsort(t, dim=1, descending=True, stable=True)[:, :k]), (rank, k)
    for kw in (dict(top_k=5), dict(top_k=9, top_p=0.6, min_k=2)):
        rec = teacher_topk_record(t[:, lo:hi].contiguous(), 12, [1.0], tp_group=dist.group.WORLD)
        x = s[:, lo:hi].contiguous()
        online = logits_kd_loss(x, t[:, lo:hi].contiguous(), tp_group=dist.group.WORLD, **kw)
        cached = cached_kd_loss(x, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0],
                                tp_group=dist.group.WORLD, **kw)
        ref = reference_kd(s.double(), t.double(), **kw)[0]
        torch.testing.assert_close(online.double(), ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(cached.double(), ref, rtol=0, atol=1e-6)
    return True


@pytest.mark.slow
def test_tp2_follows_the_same_tie_rule():
    from kdexp.distributed.testing import run_on_processes

    assert run_on_processes(_tp_tie_worker, 2, timeout=240) == [True, True]
