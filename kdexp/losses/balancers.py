"""Loss balancers: how the LM loss, the logit KD loss and the intermediate losses add up to the training loss.

- `AlphaBalancer(alpha)`: total = (1 - alpha) * lm + alpha * (kd + intermediate rescaled to |kd|). alpha == 1 skips
  the LM loss (lm may be None: the trainer need not compute it); alpha == 0 is plain LM training.
- `DynamicBalancer(kd_loss_scale, skip_lm_loss)`: ModelOpt's legacy behaviour, kept to reproduce "before" runs.
  It follows NVIDIA/TensorRT-Model-Optimizer modelopt/torch/distill/plugins/megatron.py,
  LogitsAndIntermediatesLossBalancer.forward (the version that has TopKLogitsKLLoss, i.e. ModelOpt 0.4x):
      intermediate = mean of the intermediate losses
      if intermediate > 0: intermediate_scaled = intermediate * (logits / intermediate).detach()
      if skip_lm_loss:     total = logits + intermediate_scaled
      else:                kd = logits + intermediate_scaled
                           if kd > 0 and lm > 0: kd = kd * (lm / kd).detach()    # KD rescaled to the LM magnitude
                           total = lm + kd * kd_loss_scale
  The Python `if`s on tensors there are host syncs; here they are torch.where with safe denominators (same values).

The option set is kdexp.losses.options.BalancerOptions (kdexp.config.BalancerConfig subclasses it): its `check` holds
every value rule (the constructors and config.validate call it; a key the chosen balancer does not read is an error)
and `BalancerOptions.from_config(node).build()` is the one factory from a config node (`make_balancer` for keywords).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from kdexp.losses.intermediate import mean_of, scale_to_logits_loss
from kdexp.losses.options import BALANCER_KEYS, BALANCERS, BalancerOptions

def _parts(**kw) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in kw.items() if v is not None}


def _options(name: str, kwargs: dict) -> BalancerOptions:
    """BalancerOptions for a constructor or make_balancer call: unset keys are None; an unknown keyword is a
    ValueError naming it."""
    known = [f.name for f in fields(BalancerOptions) if f.name != "name"]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"unknown balancer argument(s) {unknown} for balancer {name!r}; allowed: "
                         f"{', '.join(BALANCER_KEYS.get(name, known))}")
    return BalancerOptions(name=name, **{k: kwargs.get(k) for k in known})


class AlphaBalancer:
    """total = (1 - alpha) * lm + alpha * kd, alpha in [0, 1]."""

    def __init__(self, alpha: float = 0.5, **removed):
        _options("alpha", dict(alpha=alpha, **removed)).check()  # removed ModelOpt keys get a pointer to alpha
        self.alpha = float(alpha)

    @property
    def needs_lm_loss(self) -> bool:
        return self.alpha < 1.0

    @property
    def coefficients(self) -> tuple[float, float]:
        """(w_kd, w_lm): total = w_kd * kd + w_lm * lm, fixed for the run (a fused head may then form its gradients
        in the forward pass)."""
        return self.alpha, 1.0 - self.alpha

    def __call__(self, lm_loss, kd_loss, intermediate=None):
        inter = mean_of(intermediate)
        kd_total = None
        if kd_loss is not None:
            kd_total = kd_loss if inter is None else kd_loss + scale_to_logits_loss(inter, kd_loss)
        if self.alpha == 1.0:
            if kd_total is None:
                raise ValueError("kd_loss is None but alpha=1.0 needs the KD loss")
            total = kd_total
        elif self.alpha == 0.0:
            if lm_loss is None:
                raise ValueError("lm_loss is None but alpha=0.0 needs the LM loss")
            total = lm_loss
        else:
            if lm_loss is None or kd_total is None:
                raise ValueError(f"alpha={self.alpha} needs both lm_loss and kd_loss (got lm_loss={lm_loss is not None}"
                                 f", kd_loss={kd_loss is not None})")
            total = (1.0 - self.alpha) * lm_loss + self.alpha * kd_total
        return total, _parts(lm_loss=lm_loss, kd_loss=kd_loss, intermediate_loss=inter, total=total)

    def __repr__(self):
        return f"AlphaBalancer(alpha={self.alpha})"


class DynamicBalancer:
    """ModelOpt's LogitsAndIntermediatesLossBalancer (legacy): KD rescaled to the LM loss magnitude."""

    def __init__(self, kd_loss_scale: float = 1.0, skip_lm_loss: bool = False):
        _options("dynamic", dict(kd_loss_scale=kd_loss_scale, skip_lm_loss=skip_lm_loss)).check()
        self.kd_loss_scale = float(kd_loss_scale)
        self.skip_lm_loss = skip_lm_loss

    @property
    def needs_lm_loss(self) -> bool:
        return not self.skip_lm_loss

    def __call__(self, lm_loss, kd_loss, intermediate=None):
        if kd_loss is None:
            raise ValueError("kd_loss is required by the dynamic balancer")
        logits = kd_loss
        inter = mean_of(intermediate)
        if inter is None:
            inter_scaled = torch.zeros_like(logits)
        else:
            pos = inter.detach() > 0
            ratio = logits.detach() / torch.where(pos, inter.detach(), torch.ones_like(inter.detach()))
            inter_scaled = torch.where(pos, inter * ratio, torch.zeros_like(inter))
        if self.skip_lm_loss:
            total = logits + inter_scaled
        else:
            if lm_loss is None:
                raise ValueError("lm_loss is None but skip_lm_loss=False needs it")
            kd = logits + inter_scaled
            kd_d, lm_d = kd.detach(), lm_loss.detach()
            ok = (kd_d > 0) & (lm_d > 0)  # ModelOpt: zero when one CP rank has only context tokens
            factor = torch.where(ok, lm_d / torch.where(ok, kd_d, torch.ones_like(kd_d)), torch.ones_like(kd_d))
            total = lm_loss + kd * factor * self.kd_loss_scale
        return total, _parts(lm_loss=lm_loss, kd_loss=kd_loss, intermediate_loss=inter, total=total)

    def __repr__(self):
        return f"DynamicBalancer(kd_loss_scale={self.kd_loss_scale}, skip_lm_loss={self.skip_lm_loss})"


BALANCER_CLASSES = {"alpha": AlphaBalancer, "dynamic": DynamicBalancer}


def make_balancer(name: str, **kwargs):
    """make_balancer("alpha", alpha=0.9) / make_balancer("dynamic", kd_loss_scale=1.0, skip_lm_loss=True): the same
    factory as `BalancerOptions.from_config(node).build()`, from keywords."""
    if name not in BALANCER_CLASSES:
        raise ValueError(f"balancer name={name!r} is invalid: must be one of {', '.join(BALANCERS)}")
    return _options(name, kwargs).build()
