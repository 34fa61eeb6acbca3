"""AdamW with warmup + cosine, data-parallel gradient averaging and TP-aware gradient clipping: the torch path
(trainer.optimizer=torch, the default on the CPU; kdexp.train.megatron_optim is the CUDA one).

Used by both the student's distillation and the embedded teacher's one-time pretraining. For bf16 weights
(trainer.precision=bf16) ``make_optimizer(..., master_weights=True)`` gives :class:`MasterAdamW`: fp32 master copies
of the weights hold the AdamW state, the gradients are accumulated over micro-batches, averaged over DP and clipped
in fp32 on the masters, and each step writes the masters back rounded to bf16 (megatron's
Float16OptimizerWithFloat16Params with accumulate_allreduce_grads_in_fp32, in plain torch).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from kdexp import distributed


BETAS, EPS = (0.9, 0.95), 1e-8
# clipping counts TP shards by the first three; sum_grads_over_tp reads the last (q/k and sequence-parallel norms)
_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "tp_summed_grad")


def decays(name: str, p: torch.Tensor) -> bool:
    """Norms and biases are not decayed (the usual GPT recipe); the megatron path uses the same rule."""
    return not (p.ndim < 2 or "norm" in name)


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float,
                   master_weights: bool = False) -> torch.optim.Optimizer:
    decay, no_decay, pairs = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        target = p
        if master_weights:
            target = torch.nn.Parameter(p.detach().float().clone())
            for attr in _TP_ATTRS:  # clipping counts TP shards by these
                if hasattr(p, attr):
                    setattr(target, attr, getattr(p, attr))
            pairs.append((p, target))
        (decay if decays(name, p) else no_decay).append(target)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if master_weights:
        return MasterAdamW(groups, pairs, lr=lr, betas=BETAS, eps=EPS)
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS)


class MasterAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of low-precision model weights.

    A post-accumulate-grad hook moves each model gradient into its master's fp32 ``.grad`` as soon as the backward
    produced it (adding to what earlier micro-batches left), and frees the bf16 one: accumulation over micro-batches,
    the DP average and clipping (``grad_params``) all see fp32. ``step`` updates the masters and copies them into the
    model weights. The masters are part of ``state_dict`` so a resume continues from the exact fp32 values."""

    def __init__(self, groups, pairs, **kw):
        super().__init__(groups, **kw)
        self.pairs = pairs
        for p, master in pairs:
            p.register_post_accumulate_grad_hook(self._hook(master))

    @staticmethod
    def _hook(master):
        def move(p):
            g = p.grad.float()
            master.grad = g if master.grad is None else master.grad.add_(g)
            p.grad = None
        return move

    @property
    def master_params(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for p, master in self.pairs:
            p.copy_(master)
        return out

    def state_dict(self):
        return {**super().state_dict(), "master_params": [m.detach().clone() for m in self.master_params]}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_params")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for (p, master), saved in zip(self.pairs, masters):
                master.copy_(saved)
                p.copy_(master)


def grad_params(model: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` the DP average and clipping act on: the fp32 masters of a MasterAdamW, else the
    model's parameters."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.master_params
    return list(model.parameters())


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value


def _params(model_or_params) -> list[torch.Tensor]:
    if isinstance(model_or_params, torch.nn.Module):
        return list(model_or_params.parameters())
    return list(model_or_params)


def average_gradients(model_or_params) -> None:
    """Average gradients over the data-parallel group, in one flat bucket (one all_reduce per step); first the TP sum
    of the norm weights' partial gradients (kdexp.distributed.sum_grads_over_tp)."""
    st = distributed.state()
    distributed.sum_grads_over_tp(_params(model_or_params))
    if st.dp_size == 1:
        return
    grads = [p.grad for p in _params(model_or_params) if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=distributed.dp_group())
    flat /= st.dp_size
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def clip_gradients(model_or_params, max_norm: float) -> torch.Tensor:
    """Clip by the global L2 norm; TP-sharded parameters count once per shard, replicated ones once in all.

    Returns the norm before clipping as a tensor (no host sync here).
    """
    st = distributed.state()
    total = torch.zeros((), dtype=torch.float32, device=st.device)
    params = [p for p in _params(model_or_params) if p.grad is not None]
    for p in params:
        sharded = getattr(p, "tensor_model_parallel", False)
        if sharded or st.tp_rank == 0:
            total += p.grad.detach().float().pow(2).sum()
    if st.tp_size > 1:
        dist.all_reduce(total, group=distributed.tp_group())
    norm = total.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm
