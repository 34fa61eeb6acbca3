"""Qwen3's RMSNorm for megatron's layer spec, usable under sequence parallelism, and the TP gradient rule of its weights.

megatron-core's local spec builds ``WrappedTorchNorm`` (torch.nn.RMSNorm), which asserts ``not
config.sequence_parallel``: the TP gradient reduction of norm weights lives in Transformer Engine's and apex's norms
(they mark their weights ``sequence_parallel = True``) and in ``finalize_model_grads``
(``_allreduce_non_tensor_model_parallel_grads``), which sums over the TP group the gradients of

* every weight marked ``sequence_parallel`` when config.sequence_parallel is on (each TP rank normalised only its
  [s/t] slice of the tokens, so its gradient is a partial sum), and
* the q/k layernorm weights whenever qk_layernorm is on (each TP rank normalised only its heads).

:class:`RMSNorm` is torch.nn.RMSNorm (same numerics and state-dict keys as the local spec's) built from megatron's
norm arguments, marking its weight as TE's norms do. :func:`mark_tp_summed` tags the weights of that rule with
``tp_summed_grad = True`` (an attribute the optimizer's fp32 masters copy), and
kdexp.distributed.sum_grads_over_tp sums their gradients before the DP average and clipping. Without it a TP=2 run's
q/k norm weights would drift apart per rank (and under sequence parallelism every norm weight would).
"""
from __future__ import annotations

import torch

TP_SUMMED = "tp_summed_grad"  # parameter attribute: its gradient is a partial sum per TP rank


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with megatron's norm-builder signature; its weight carries ``sequence_parallel`` as TE's does."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
        if config.normalization != "RMSNorm":
            raise ValueError(f"kdexp's norm is RMSNorm, the config asks for {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def mark_tp_summed(model: torch.nn.Module, tp: int, sequence_parallel: bool) -> list[str]:
    """Tag (``tp_summed_grad = True``) the parameters whose gradients megatron's finalize_model_grads sums over TP:
    the q/k layernorm weights at TP > 1, and with sequence parallelism every weight marked ``sequence_parallel``.
    Returns their names."""
    names = []
    if tp == 1:
        return names
    for name, p in model.named_parameters():
        qk = "q_layernorm" in name or "k_layernorm" in name
        if qk or (sequence_parallel and getattr(p, "sequence_parallel", False)):
            setattr(p, TP_SUMMED, True)
            names.append(name)
    return names
