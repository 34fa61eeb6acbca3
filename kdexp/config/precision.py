"""The one rule for a run's numeric formats: which dtype the student's weights, its gradients, the optimizer's master
weights and Adam moments have, and whether the optimizer state is split over data-parallel ranks, for every
combination of model.params_dtype, trainer.precision, trainer.optimizer and trainer.distributed_optimizer.

Torch-free (dtype names as strings) so that kdexp.plan sizes exactly what kdexp.train builds: the trainer asks it which
dtype to build the student in, whether the torch optimizer keeps fp32 masters, which optimizer path it takes and how
megatron's DDP and optimizer are configured; the plan asks it how many bytes each of those holds per parameter.

The rule: weights are bf16 when trainer.precision=bf16 or model.params_dtype=bfloat16 (the teacher too: it is cast
or built in that dtype), else fp32. Low-precision weights always get fp32 master copies, fp32 gradients (the torch
path moves each bf16 gradient into its master's fp32 one as the backward produces it; megatron's DDP reduces into
contiguous fp32 buffers, grad_reduce_in_fp32) and fp32 Adam moments, as megatron's Float16Optimizer keeps them. fp32
weights are their own masters. trainer.distributed_optimizer (megatron only) splits masters and moments over DP; the
gradient buffer stays whole on every rank (megatron reduce-scatters it in place).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BYTES = {"float32": 4, "bfloat16": 2}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Formats:
    weights: str  # the student's (and the teacher's) parameter dtype: float32 | bfloat16
    grads: str  # the gradients the optimizer reads (accumulated over micro-batches, DP-averaged, clipped)
    master: Optional[str]  # the optimizer's master copy of the weights, None when the weights are their own masters
    moments: str  # Adam's m and v
    megatron: bool  # megatron's DDP + optimizer (else kdexp.train.optim's torch AdamW)
    sharded: bool  # masters and moments split over the data-parallel ranks (megatron's DistributedOptimizer)

    @property
    def weight_bytes(self) -> int:
        return BYTES[self.weights]

    @property
    def grad_bytes(self) -> int:
        return BYTES[self.grads]

    @property
    def optimizer_bytes(self) -> int:
        """Per parameter on one DP rank before sharding: the master copy (if any) and the two moments."""
        return (BYTES[self.master] if self.master else 0) + 2 * BYTES[self.moments]

    @property
    def label(self) -> str:
        w = SHORT[self.weights]
        return f"{w} weights, {SHORT[self.grads]} grads, " + \
            (f"{SHORT[self.master]} master + " if self.master else "") + f"{SHORT[self.moments]} Adam m, v"


def uses_megatron(optimizer: str, cuda: bool) -> bool:
    """trainer.optimizer -> whether megatron's optimizer runs: auto takes it exactly when CUDA is there."""
    return optimizer == "megatron" or (optimizer == "auto" and cuda)


def formats(params_dtype: str, precision: str, optimizer: str = "auto", distributed_optimizer: bool = False, *,
            cuda: bool) -> Formats:
    """The formats a run with these settings keeps; `cuda`: whether it runs on GPUs (kdexp.plan sizes a GPU run)."""
    if params_dtype not in BYTES:
        raise ValueError(f"model.params_dtype={params_dtype!r} is invalid: must be one of {', '.join(BYTES)}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"trainer.precision={precision!r} is invalid: must be one of fp32, bf16")
    megatron = uses_megatron(optimizer, cuda)
    weights = "bfloat16" if precision == "bf16" or params_dtype == "bfloat16" else "float32"
    return Formats(weights=weights, grads="float32", master="float32" if weights != "float32" else None,
                   moments="float32", megatron=megatron, sharded=megatron and bool(distributed_optimizer))


def of(cfg, *, cuda: bool) -> Formats:
    """`formats` of a composed config."""
    t = cfg.trainer
    return formats(cfg.model.params_dtype, t.precision, t.optimizer, t.distributed_optimizer, cuda=cuda)
