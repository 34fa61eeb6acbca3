"""AdamW with warmup + cosine, data-parallel gradient averaging and TP-aware gradient clipping.

Used by both the student's distillation and the embedded teacher's one-time pretraining.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from kdexp import distributed


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # norms and biases are not decayed (the usual GPT recipe)
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value


def average_gradients(model: torch.nn.Module) -> None:
    """Average gradients over the data-parallel group, in one flat bucket (one all_reduce per step)."""
    st = distributed.state()
    if st.dp_size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=distributed.dp_group())
    flat /= st.dp_size
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global L2 norm; TP-sharded parameters count once per shard, replicated ones once in all.

    Returns the norm before clipping as a tensor (no host sync here).
    """
    st = distributed.state()
    total = torch.zeros((), dtype=torch.float32, device=st.device)
    params = [p for p in model.parameters() if p.grad is not None]
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
