"""The CPU Top-K kernel (kdexp/losses/_native.c) against the eager torch code it replaces and a float64 reference.

The kernel computes the held-gradient path (Top-K without a nucleus cut, no TP, float32 on CPU): every test here runs
the same call twice, kernel and eager (the kernel switched off), and holds both to the float64 reference
(tests/_kd_reference.py), so the eager code stays tested where the kernel now runs by default. The far-tail case
(mass outside S below 1e-20 of the row max's, where the kernel recomputes the complement in its own frame) and the
failure modes (no compiler, a bad index, a non-finite logit) are tried explicitly."""
import contextlib
import logging
import math

import pytest
import torch

from _kd_reference import reference_kd
from kdexp.losses import _native, cached_kd_loss, logits_kd_loss, teacher_topk_record


@contextlib.contextmanager
def kernel_off():
    saved = _native._state.get("lib")
    _native._state["lib"] = None
    try:
        yield
    finally:
        _native._state["lib"] = saved


def test_this_machine_builds_the_kernel():
    # CI has a C compiler, so the kernel must be what the suite's CPU losses run (not a silent eager fallback)
    assert _native.kernel() is not None
    assert _native.serves(torch.zeros(2, 4), torch.zeros(2, 4))
    assert not _native.serves(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4))
    assert not _native.serves(torch.zeros(2, 4), None)


def _logits(n=40, v=97, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale, torch.randn(n, v, generator=g) * scale


def _run(student, teacher, labels=None, **opts):
    s = student.clone().requires_grad_(True)
    out, stats = logits_kd_loss(s, teacher, return_stats=True, labels=labels, **opts)
    kd, lm = out if labels is not None else (out, None)
    total = kd.double().sum() + (0.0 if lm is None else 0.7 * lm.double().sum())
    total.backward()
    return kd.detach(), lm, s.grad, stats


OPTIONS = {
    "top_k": dict(top_k=16),
    "top_k_no_ghost": dict(top_k=16, ghost_token=False),
    "all_kept": dict(top_k=97),
    "T2": dict(top_k=24, temperature=2.0),
    "T0.5_t2": dict(top_k=24, temperature=0.5, scale_by_temperature_squared=True),
    "reverse_kl": dict(top_k=16, divergence="reverse_kl"),
    "jsd": dict(top_k=16, divergence="jsd", beta=0.3),
    "renormalize_stats": dict(top_k=16, ghost_token=False, normalization="renormalize"),
    "top_k_lm": dict(top_k=16, lm=True),
    "all_kept_lm": dict(top_k=97, lm=True),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_kernel_equals_eager_and_float64(name):
    opts = dict(OPTIONS[name])
    student, teacher = _logits()
    labels = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)) if opts.pop("lm", False) \
        else None
    if labels is not None:
        labels[3] = -100  # ignored
    got = _run(student, teacher, labels, **opts)
    with kernel_off():
        eager = _run(student, teacher, labels, **opts)
    s64 = student.double().requires_grad_(True)
    ref_kd = reference_kd(s64, teacher.double(), **opts)[0]
    total = ref_kd.sum()
    if labels is not None:
        valid = labels >= 0
        ref_lm = torch.where(valid, -torch.log_softmax(s64, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
        total = total + 0.7 * ref_lm.sum()
        torch.testing.assert_close(got[1].double(), ref_lm.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], eager[1], rtol=1e-6, atol=1e-6)
    total.backward()
    torch.testing.assert_close(got[0].double(), ref_kd.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], eager[0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got[2].double(), s64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], eager[2], rtol=1e-5, atol=1e-6)  # exps 1 ulp apart, differences of them
    for field, a, b in zip(got[3]._fields, got[3], eager[3]):
        # masses are differences from 1 in float32 (kept = -expm1(log residual)): ~1e-7 absolute
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"stat {field}")


def test_far_tail_rows_keep_relative_precision():
    """Rows whose mass outside S is 1e-26 .. 1e-104 of the max's (the kernel's second frame) and rows at 1e-9 (its
    first): the student residual mass (the ghost bucket), the loss and the gradient outside S against float64."""
    n, v, k = 8, 64, 8
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(n, v, generator=g)
    teacher[:, :k] += 40.0  # the teacher's top-8 are columns 0..7 in every row
    student = torch.randn(n, v, generator=g)
    gaps = torch.tensor([20.0, 60.0, 100.0, 240.0, 20.0, 60.0, 100.0, 240.0])
    student[:, :k] += gaps[:, None]  # S far above the rest: residual ~ exp(-gap)
    for temperature in (1.0, 2.0):
        got = _run(student, teacher, top_k=k, temperature=temperature)
        with kernel_off():
            eager = _run(student, teacher, top_k=k, temperature=temperature)
        s64 = student.double().requires_grad_(True)
        ref = reference_kd(s64, teacher.double(), top_k=k, temperature=temperature)
        ref[0].sum().backward()
        ref_res = torch.tensor(ref[1]["student_residual_mass"], dtype=torch.float64)
        for out in (got, eager):
            res = out[3].student_residual_mass.double()
            normal = ref_res > 1e-36  # the stat is float32: 1e-42 and 1e-104 are below its range (the loss and
            assert normal.sum() >= 4  # gradient, from the log of the residual, are checked for every row below)
            rel = ((res - ref_res) / ref_res)[normal].abs().max().item()
            assert rel < 1e-4, f"T={temperature}: residual mass off by {rel:.1e} relative ({res} vs {ref_res})"
            torch.testing.assert_close(out[0].double(), ref[0].detach(), rtol=1e-5, atol=1e-6)
            outside = out[2][:, k:].double()
            want = s64.grad[:, k:]
            big = want.abs() > 1e-30
            rel_g = ((outside - want)[big] / want[big]).abs().max().item()
            assert rel_g < 1e-4, f"T={temperature}: gradient outside S off by {rel_g:.1e} relative"


def test_cached_loss_runs_the_kernel_and_equals_the_online_loss():
    student, teacher = _logits(n=32, v=130, seed=5)
    rec = teacher_topk_record(teacher, 40, [1.0])
    calls = []
    real = _native.topk_forward

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    _native.topk_forward = counting
    try:
        s = student.clone().requires_grad_(True)
        kd = cached_kd_loss(s, rec.values, rec.indices, rec.lse[:, 0], rec.lse_rest[:, 0], top_k=40)
        kd.sum().backward()
    finally:
        _native.topk_forward = real
    assert calls, "the cached Top-K loss did not run the kernel"
    online = _run(student, teacher, top_k=40)
    torch.testing.assert_close(kd.detach(), online[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.grad, online[2], rtol=1e-5, atol=1e-8)


def test_a_non_finite_logit_gives_a_non_finite_loss():
    student, teacher = _logits(n=6, v=50)
    for bad, col in ((math.nan, 0), (math.nan, 49), (math.inf, 7)):
        s = student.clone()
        s[2, col] = bad
        loss = logits_kd_loss(s, teacher, top_k=10)
        assert not torch.isfinite(loss[2]), f"{bad} at column {col} gave a finite loss"
        assert torch.isfinite(loss[[0, 1, 3, 4, 5]]).all()


def test_an_index_outside_the_vocabulary_is_an_error():
    student, teacher = _logits(n=4, v=50)
    rec = teacher_topk_record(teacher, 8, [1.0])
    idx = rec.indices.clone()
    idx[1, 3] = 50
    with pytest.raises(IndexError, match="row 1"):
        cached_kd_loss(student.clone().requires_grad_(True), rec.values, idx, rec.lse[:, 0], rec.lse_rest[:, 0],
                       top_k=8)


def test_without_a_compiler_the_eager_code_runs_and_says_why(monkeypatch, caplog):
    saved = dict(_native._state)
    try:
        _native._state.clear()
        monkeypatch.setenv("CC", "kdexp-no-such-compiler")
        with caplog.at_level(logging.WARNING, logger="kdexp"):
            assert _native.kernel() is None
        assert "no C compiler" in caplog.text
        student, teacher = _logits(n=5, v=40)
        eager = logits_kd_loss(student, teacher, top_k=6)
        _native._state.clear()
        monkeypatch.setenv("KDEXP_NATIVE", "0")
        monkeypatch.delenv("CC")
        caplog.clear()
        assert _native.kernel() is None and "compiler" not in caplog.text  # a choice: no warning
    finally:
        _native._state.clear()
        _native._state.update(saved)
    torch.testing.assert_close(eager, logits_kd_loss(student, teacher, top_k=6), rtol=2e-6, atol=1e-6)


def test_a_failed_build_is_a_warning_not_an_error(monkeypatch, tmp_path, caplog):
    saved = dict(_native._state)
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    try:
        _native._state.clear()
        monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(_native, "SOURCE", bad)
        with caplog.at_level(logging.WARNING, logger="kdexp"):
            assert _native.kernel() is None
        assert "could not be built" in caplog.text
        assert not list((tmp_path / "cache" / "native").glob("*.so"))  # no half-built library left behind
    finally:
        _native._state.clear()
        _native._state.update(saved)


def test_the_build_is_cached_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path))
    first = _native._build("cc")
    assert first.parent == tmp_path / "native" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert _native._build("cc") == first and first.stat().st_mtime_ns == stamp  # found, not rebuilt


@pytest.mark.parametrize("temperature,lm", [(1.0, True), (1.0, False), (2.0, False), (0.5, False)])
def test_sampled_kernel_equals_eager_and_float64(temperature, lm):
    from kdexp.losses import sampled_kd_loss
    student, _ = _logits(n=30, v=120, seed=7, scale=4.0)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 120, (30, 12), generator=g)
    weights = torch.rand(30, 12, generator=g)
    target = -torch.rand(30, 12, generator=g) * 5
    labels = torch.randint(0, 120, (30,), generator=g) if lm else None
    if lm:
        labels[5] = -100

    def run(x):
        s = x.clone().requires_grad_(True)
        out = sampled_kd_loss(s, ids, weights, target, temperature=temperature, labels=labels)
        kd, lm_ = out if lm else (out, None)
        (kd.double().sum() + (0.0 if lm_ is None else 0.7 * lm_.double().sum())).backward()
        return kd.detach(), lm_, s.grad

    got = run(student)
    with kernel_off():
        eager = run(student)
    ref = run(student.double())
    for a, b, c in zip(got, eager, ref):
        if a is None:
            continue
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.double(), c.detach(), rtol=1e-5, atol=1e-6)


def test_sampled_kernel_runs_and_refuses_a_bad_id():
    from kdexp.losses import sampled_kd_loss
    assert _native.serves(torch.zeros(2, 3), sampled=True)
    student, _ = _logits(n=4, v=20)
    ids = torch.randint(0, 20, (4, 3))
    ids[2, 1] = 20
    with pytest.raises(IndexError, match="row 2"):
        sampled_kd_loss(student, ids, torch.ones(4, 3))
