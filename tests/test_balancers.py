"""Balancers (alpha, ModelOpt-compatible dynamic) and hidden-state losses."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from kdexp.losses import (
    AlphaBalancer,
    BalancerOptions,
    DynamicBalancer,
    IntermediateLoss,
    cosine_hidden_loss,
    make_balancer,
    mse_hidden_loss,
    scale_to_logits_loss,
)


def _scalars(*values):
    return [torch.tensor(float(v), dtype=torch.float64, requires_grad=True) for v in values]


def _modelopt_dynamic(original_loss, logits_loss, intermediates, kd_loss_scale, skip_original_loss):
    """Transcription of ModelOpt's LogitsAndIntermediatesLossBalancer.forward (modelopt/torch/distill/plugins/
    megatron.py), Python `if`s on tensors and all, as the independent reference."""
    intermediate_loss = sum(intermediates) / max(len(intermediates), 1)
    if intermediate_loss > 0:
        dynamic_scale = logits_loss.detach() / intermediate_loss.detach()
        intermediate_loss_scaled = intermediate_loss * dynamic_scale
    else:
        intermediate_loss = logits_loss.new_tensor(intermediate_loss)
        intermediate_loss_scaled = intermediate_loss
    if skip_original_loss:
        total_loss = logits_loss + intermediate_loss_scaled
    else:
        kd_loss = logits_loss + intermediate_loss_scaled
        if kd_loss > 0 and original_loss > 0:
            kd_loss *= original_loss.detach() / kd_loss.detach()
        total_loss = original_loss + kd_loss * kd_loss_scale
    return total_loss


def test_alpha_formula_and_gradients():
    lm, kd = _scalars(2.0, 0.5)
    total, parts = AlphaBalancer(alpha=0.3)(lm, kd)
    total.backward()
    assert float(total.detach()) == pytest.approx(0.7 * 2.0 + 0.3 * 0.5)
    assert float(lm.grad) == pytest.approx(0.7) and float(kd.grad) == pytest.approx(0.3)
    assert float(parts["lm_loss"]) == 2.0 and float(parts["kd_loss"]) == 0.5
    assert not parts["total"].requires_grad


def test_alpha_one_needs_no_lm_loss_and_zero_is_lm_only():
    (kd,) = _scalars(0.8)
    total, parts = AlphaBalancer(alpha=1.0)(None, kd)
    assert float(total.detach()) == pytest.approx(0.8) and "lm_loss" not in parts
    assert not AlphaBalancer(alpha=1.0).needs_lm_loss and AlphaBalancer(alpha=0.99).needs_lm_loss
    (lm,) = _scalars(3.0)
    total, _ = AlphaBalancer(alpha=0.0)(lm, None)
    assert float(total.detach()) == 3.0
    with pytest.raises(ValueError, match="lm_loss"):
        AlphaBalancer(alpha=0.5)(None, kd)


def test_alpha_with_intermediate_rescaled_to_kd():
    lm, kd, h1, h2 = _scalars(2.0, 0.5, 0.2, 0.6)
    total, parts = AlphaBalancer(alpha=0.5)(lm, kd, [h1, h2])
    # mean intermediate 0.4, rescaled to |kd| = 0.5 -> kd part = 0.5 + 0.5
    assert float(total.detach()) == pytest.approx(0.5 * 2.0 + 0.5 * 1.0)
    assert float(parts["intermediate_loss"]) == pytest.approx(0.4)
    total.backward()
    assert float(h1.grad) == pytest.approx(0.5 * 0.5 / 0.4 / 2)  # detached ratio times the mean's 1/2


@pytest.mark.parametrize("alpha", [-0.1, 1.5, "0.5", True])
def test_alpha_out_of_range(alpha):
    with pytest.raises(ValueError, match=rf"^alpha={alpha!r} is invalid: must be a number in \[0, 1\]$"):
        AlphaBalancer(alpha=alpha)


@pytest.mark.parametrize("key, value", [("skip_lm_loss", True), ("kd_loss_scale", 2.0)])
def test_alpha_rejects_removed_modelopt_keys(key, value):
    with pytest.raises(ValueError, match=rf"{key}.*use alpha.*skip_lm_loss=True means alpha=1\.0"):
        AlphaBalancer(alpha=0.5, **{key: value})
    with pytest.raises(ValueError, match=rf"^{key}=.* was removed from the alpha balancer.*use alpha"):
        make_balancer("alpha", **{key: value})


@pytest.mark.filterwarnings("ignore:To copy construct")  # ModelOpt's own new_tensor call in the transcription
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("values", [
    (2.0, 0.5, []), (2.0, 0.5, [0.2, 0.6]), (0.0, 0.5, [0.3]), (2.0, 0.5, [0.0]), (1.3, 0.0, []),
])
@pytest.mark.parametrize("kd_loss_scale", [1.0, 0.25])
def test_dynamic_matches_modelopt(skip, values, kd_loss_scale):
    lm_v, kd_v, inter_v = values
    a = _scalars(lm_v, kd_v, *inter_v)
    b = _scalars(lm_v, kd_v, *inter_v)
    ref = _modelopt_dynamic(a[0], a[1], a[2:], kd_loss_scale, skip)
    total, parts = DynamicBalancer(kd_loss_scale=kd_loss_scale, skip_lm_loss=skip)(b[0], b[1], b[2:] or None)
    torch.testing.assert_close(total, ref)
    ref.backward()
    total.backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad if y.grad is not None else torch.zeros(()).double(),
                                   x.grad if x.grad is not None else torch.zeros(()).double())
    assert float(parts["kd_loss"]) == kd_v


def test_balancers_make_no_host_syncs():
    # Under FakeTensorMode any .item() / `if tensor` raises: the balancers must stay on-device throughout.
    with FakeTensorMode():
        lm, kd, h = torch.rand(()), torch.rand(()), torch.rand(())
        for bal in (AlphaBalancer(alpha=0.4), DynamicBalancer(), DynamicBalancer(skip_lm_loss=True)):
            total, _ = bal(lm, kd, [h, h])
            assert total.shape == ()
        scale_to_logits_loss(h, kd)
        with pytest.raises(DataDependentOutputException, match="_local_scalar_dense"):
            bool(h > 0)  # the mode does catch a host sync (a read of the value: aten._local_scalar_dense)


def test_make_balancer():
    assert isinstance(make_balancer("alpha", alpha=0.2), AlphaBalancer)
    d = make_balancer("dynamic", kd_loss_scale=0.5, skip_lm_loss=True)
    assert isinstance(d, DynamicBalancer) and d.kd_loss_scale == 0.5 and d.skip_lm_loss
    with pytest.raises(ValueError, match=r"^balancer name='static' is invalid: must be one of alpha, dynamic$"):
        make_balancer("static")
    with pytest.raises(ValueError, match=r"^alpha=0.5 is invalid: balancer 'dynamic' ignores it"):
        make_balancer("dynamic", alpha=0.5)
    with pytest.raises(ValueError, match=r"^kd_loss_scale=0.0 is invalid: must be a finite number > 0$"):
        DynamicBalancer(kd_loss_scale=0.0)
    with pytest.raises(ValueError, match=r"^skip_lm_loss=1 is invalid: must be true or false$"):
        DynamicBalancer(skip_lm_loss=1)
    with pytest.raises(ValueError, match=r"unknown balancer argument\(s\) \['beta'\] for balancer 'alpha'"):
        make_balancer("alpha", beta=0.5)


@pytest.mark.parametrize("node, expected", [
    (dict(name="alpha", alpha=0.3, kd_loss_scale=None, skip_lm_loss=None), "AlphaBalancer(alpha=0.3)"),
    (dict(name="dynamic", alpha=None, kd_loss_scale=None, skip_lm_loss=True),
     "DynamicBalancer(kd_loss_scale=1.0, skip_lm_loss=True)"),  # unset keys take the constructor's defaults
])
def test_balancer_options_build_from_a_config_node(node, expected):
    assert repr(BalancerOptions.from_config(node).build()) == expected


@pytest.mark.parametrize("node, match", [
    (dict(name="dynamic", alpha=5.0), r"^balancer.alpha=5.0 is invalid: balancer 'dynamic' ignores it"),
    (dict(name="alpha", alpha=float("nan")), r"^balancer.alpha=nan is invalid: must be a number in \[0, 1\]$"),
    (dict(name="alpha", skip_lm_loss=False), r"^balancer.skip_lm_loss=False was removed .* use balancer.alpha"),
    (dict(name="static"), r"^balancer.name='static' is invalid"),
])
def test_balancer_options_name_the_key(node, match):
    with pytest.raises(ValueError, match=match):
        BalancerOptions(**node).check(prefix="balancer.")


def test_hidden_losses_against_float64_formulas():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 16, generator=g, requires_grad=True)
    t = torch.randn(2, 3, 16, generator=g, requires_grad=True)
    sd, td = s.detach().double(), t.detach().double()
    cos = (sd * td).sum(-1) / (sd.norm(dim=-1) * td.norm(dim=-1))
    torch.testing.assert_close(cosine_hidden_loss(s, t).double(), 1 - cos, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mse_hidden_loss(s, t).double(), ((sd - td) ** 2).mean(-1), rtol=1e-5, atol=1e-6)
    (cosine_hidden_loss(s, t).sum() + mse_hidden_loss(s, t).sum()).backward()
    assert t.grad is None and s.grad is not None
    with pytest.raises(ValueError, match="differ"):
        cosine_hidden_loss(s, t[..., :8])


def test_intermediate_loss_projection():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 8, generator=g), torch.randn(4, 12, generator=g)
    loss_fn = IntermediateLoss("mse", student_hidden=8, teacher_hidden=12)
    assert isinstance(loss_fn.projection, torch.nn.Linear)
    out = loss_fn(s, t)
    assert out.shape == (4,)
    out.sum().backward()
    assert loss_fn.projection.weight.grad is not None and loss_fn.projection.weight.grad.abs().sum() > 0
    assert isinstance(IntermediateLoss("cosine", 8, 8).projection, torch.nn.Identity)
    with pytest.raises(ValueError, match="kind"):
        IntermediateLoss("l1")


def test_scale_to_logits_loss():
    inter, logits = _scalars(0.25, -3.0)
    out = scale_to_logits_loss(inter, logits)
    assert float(out.detach()) == pytest.approx(3.0)  # magnitude |logits loss|
    out.backward()
    assert float(inter.grad) == pytest.approx(12.0) and logits.grad is None  # detached ratio
    zero = torch.zeros((), requires_grad=True)
    out = scale_to_logits_loss(zero, torch.tensor(2.0))
    out.backward()
    assert float(out.detach()) == 0.0 and float(zero.grad) == 0.0  # no NaN from 0/0
