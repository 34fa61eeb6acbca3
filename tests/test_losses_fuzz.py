"""Property tests (hypothesis): the CPU kernel's entry points and the loss API on random shapes, strides
(non-contiguous views), dtypes, ids (in and out of range) and values (inf, nan, huge). Whatever the input, a call
returns values or raises ValueError / IndexError: never another exception, never a crash of the process (the kernel
reads and writes raw pointers). Bounded (a fixed number of examples, no deadline): a few seconds."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kdexp.losses import (_native, cached_kd_loss, logits_kd_loss, sample_teacher, sampled_kd_loss,
                          teacher_topk_record)

SETTINGS = dict(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPECIAL = [0.0, -0.0, 1e30, -1e30, 3e38, -3e38, math.inf, -math.inf, math.nan, 300.0, -300.0]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
OK = (ValueError, IndexError)


@st.composite
def matrices(draw, n=None, v=None, dtype=None):
    """[n, v] tensors, some non-contiguous (a column slice of a wider one, a transpose, a row step), with special
    values sprinkled in."""
    n = draw(st.integers(0, 5)) if n is None else n
    v = draw(st.integers(1, 24)) if v is None else v
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1.0, 5.0, 100.0]))
    layout = draw(st.sampled_from(["plain", "wide", "transposed", "step"]))
    base = {"plain": (n, v), "wide": (n, v + 3), "transposed": (v, n), "step": (2 * n, v)}[layout]
    x = torch.randn(*base, generator=g, dtype=torch.float64) * scale
    x = {"plain": x, "wide": x[:, 1:v + 1], "transposed": x.t(), "step": x[::2]}[layout]
    for _ in range(draw(st.integers(0, 3))):
        if x.numel():
            i, j = draw(st.integers(0, n - 1)) if n else 0, draw(st.integers(0, v - 1))
            x[i, j] = draw(st.sampled_from(SPECIAL))
    return x.to(dtype)


@st.composite
def ids_for(draw, n, v, k=None):
    k = draw(st.integers(1, max(1, v + 2))) if k is None else k
    bad = draw(st.booleans())
    hi = v + 2 if bad else v
    lo = -2 if bad else 0
    ids = torch.tensor(draw(st.lists(st.integers(lo, hi - 1), min_size=n * k, max_size=n * k)),
                       dtype=torch.long).view(n, k)
    if draw(st.booleans()) and k > 1:
        ids = torch.cat([ids, ids], 1)[:, ::2]  # a column stride of 2
    return ids


def _backward(out):
    loss = out[0] if isinstance(out, tuple) else out
    if isinstance(loss, tuple):
        loss = loss[0]
    if loss.requires_grad:
        loss.double().sum().backward()


@settings(**SETTINGS)
@given(data=st.data())
def test_the_kernel_entry_points_never_crash(data):
    if _native.kernel() is None:
        pytest.skip("no C compiler: the kernel is not built")
    z = data.draw(matrices(dtype=data.draw(st.sampled_from([torch.float32, torch.float32, torch.float64]))))
    n, v = z.shape
    ids = data.draw(ids_for(n, v))
    k = ids.shape[1]
    t = data.draw(st.sampled_from([1.0, 0.5, 3.0, math.inf, math.nan, 0.0]))
    try:
        e, b, p, row = _native.topk_forward(z, ids, t, torch.empty(n, v),
                                            data.draw(st.sampled_from([None, torch.randn(n, k)])))
        _native.topk_backward_(torch.randn(n, v), ids, e, torch.rand(n, k), row[:, 0], row[:, 1], row[:, 2])
    except OK:
        pass
    try:
        c, lse, picked = _native.sampled_forward(z, ids, t)
        g = _native.sampled_backward(z, t, c, lse, torch.ones(n), ids, torch.randn(n, k))
        assert g.shape == (n, v)
    except OK:
        pass


@st.composite
def loss_options(draw, v):
    kw = {}
    if draw(st.booleans()):
        kw["top_k"] = draw(st.one_of(st.integers(0, v + 1), st.sampled_from([None, 2.5, True])))
    if draw(st.booleans()):
        kw["top_p"] = draw(st.sampled_from([None, 0.5, 0.9, 1.0, 0.0, 1.5, math.nan, math.inf]))
    if draw(st.booleans()):
        kw["min_k"] = draw(st.integers(0, 4))
    kw["temperature"] = draw(st.sampled_from([1.0, 1.0, 2.0, 0.5, math.inf, math.nan, 0.0, -1.0]))
    kw["divergence"] = draw(st.sampled_from(["forward_kl", "reverse_kl", "jsd", "kl"]))
    kw["ghost_token"] = draw(st.sampled_from([True, False]))
    if draw(st.booleans()):
        kw["normalization"] = "renormalize"
    if draw(st.booleans()):
        kw["beta"] = draw(st.sampled_from([0.3, 0.0, 1.0, math.nan]))
    if draw(st.booleans()):
        kw["chunk_tokens"] = draw(st.sampled_from([1, 2, 0, None]))
    return kw


@settings(**SETTINGS)
@given(data=st.data())
def test_the_online_loss_never_crashes(data):
    s = data.draw(matrices())
    n, v = s.shape
    t = data.draw(matrices(n=n, v=v))
    kw = data.draw(loss_options(v))
    if data.draw(st.booleans()):
        kw["labels"] = torch.tensor(data.draw(st.lists(st.integers(-2, v + 1), min_size=n, max_size=n)),
                                    dtype=torch.long)
    s = s.clone().requires_grad_(data.draw(st.booleans()))
    try:
        out = logits_kd_loss(s, t, return_stats=data.draw(st.booleans()), **kw)
    except OK:
        return
    _backward(out)


@settings(**SETTINGS)
@given(data=st.data())
def test_the_cached_loss_never_crashes(data):
    t = data.draw(matrices())
    n, v = t.shape
    k_max = data.draw(st.integers(1, v))
    rec = teacher_topk_record(t, k_max, [1.0, 2.0])
    idx = rec.indices.clone()
    if data.draw(st.booleans()) and idx.numel():
        idx[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, k_max - 1))] = data.draw(
            st.sampled_from([-1, v, 10**12]))
    values = rec.values.to(data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))
    s = data.draw(matrices(n=n, v=v)).clone().requires_grad_(True)
    kw = data.draw(loss_options(v))
    kw["temperature"] = 1.0
    kw.setdefault("top_k", k_max)
    try:
        out = cached_kd_loss(s, values, idx, rec.lse[:, 0], rec.lse_rest[:, 0], **kw)
    except OK:
        return
    _backward(out)


@settings(**SETTINGS)
@given(data=st.data())
def test_sampling_and_the_sampled_loss_never_crash(data):
    t = data.draw(matrices())
    n, v = t.shape
    temperature = data.draw(st.sampled_from([1.0, 2.0, math.inf, 0.0]))
    try:
        smp = sample_teacher(t, samples=data.draw(st.integers(0, 6)), temperature=temperature,
                             proposal_temperature=data.draw(st.sampled_from([1.0, 0.5, math.nan])),
                             seed=data.draw(st.integers(0, 9)))
        ids, weights, logp = smp.ids, smp.weights, smp.teacher_logprobs
    except OK:
        ids = data.draw(ids_for(n, v))
        weights = torch.rand(ids.shape, dtype=torch.float64)
        logp = None
    if data.draw(st.booleans()) and ids.numel():
        ids = ids.clone()
        ids[0, 0] = data.draw(st.sampled_from([-1, v, 2**40]))
    s = data.draw(matrices(n=n, v=v)).clone().requires_grad_(True)
    try:
        out = sampled_kd_loss(s, ids, weights, logp, temperature=data.draw(st.sampled_from([1.0, 2.0, math.inf])))
    except OK:
        return
    _backward(out)
