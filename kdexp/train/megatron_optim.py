"""The CUDA optimizer path: megatron-core's DistributedDataParallel + get_megatron_optimizer for the student.

trainer.optimizer=auto takes it on CUDA (torch on the CPU); =megatron forces it (a clear error without CUDA);
=torch keeps kdexp.train.optim everywhere. What megatron brings over the torch path:

- DDP with contiguous fp32 gradient buffers (grad_reduce_in_fp32), bucketed all_reduce overlapped with the backward
  of the last micro-batch (overlap_grad_reduce; earlier micro-batches accumulate under ``no_sync``), averaging over
  DP (1 / DP, the convention kdexp.objective.token_share assumes);
- the mixed-precision optimizer (bf16 weights, fp32 main params and Adam state; torch.optim.AdamW or TE/apex
  FusedAdam, whichever megatron finds), TP-aware grad-norm clipping (clip_grad), and with
  trainer.distributed_optimizer the ZeRO-1 DistributedOptimizer (main params and Adam state sharded over DP).

Why not on the CPU: megatron-core 0.16.1's optimizers allocate on ``device='cuda'`` literally (found_inf,
the multi-tensor-applier overflow buffers, clip_grads' norm tensor) and check ``param.type()`` against
'torch.cuda.*Tensor' strings; no torch.cuda.current_device answer in kdexp.distributed.cpu reaches those, and
gloo has no reduce_scatter for the distributed optimizer. tests/test_optim.py checks on the CPU what can be
checked: the two paths' weight-decay groups, clipping and Adam math agree on the same gradients.

Checkpoints (kdexp.train.checkpoint, one file per TP rank written by DP rank 0): the model shard plus
``optimizer.state_dict()``; with the distributed optimizer also ``get_parameter_state_dp_zero()`` (the DP shards
gathered to DP rank 0) and on load ``load_parameter_state_from_dp_zero`` scatters them back, so a resume is exact.
A checkpoint resumes at the TP size that wrote it (both paths); another TP size goes through the HF export
(trainer.export_hf / model.student_path), which restarts the optimizer state.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from kdexp import distributed
from kdexp.config import precision
from kdexp.models import DTYPES
from kdexp.train.optim import BETAS, EPS


def uses_megatron(optimizer: str) -> bool:
    """trainer.optimizer -> whether this process takes the megatron path (auto: exactly when CUDA is there)."""
    if optimizer == "megatron" and not torch.cuda.is_available():
        raise ValueError("trainer.optimizer='megatron' is invalid here: megatron-core's optimizers need CUDA "
                         "(use trainer.optimizer=auto or torch on a CPU machine)")
    return precision.uses_megatron(optimizer, torch.cuda.is_available())


def optimizer_config(t, formats: precision.Formats):
    """trainer.* -> megatron's OptimizerConfig: the same AdamW (betas, eps, decoupled weight decay) and clipping as
    kdexp.train.optim; bf16 weights get fp32 main params and Adam state (kdexp.config.precision's rule)."""
    from megatron.core.optimizer import OptimizerConfig

    if formats.master not in (None, "float32") or formats.moments != "float32":
        raise ValueError(f"megatron's optimizer keeps fp32 main params and Adam state, not {formats.label}")
    return OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                           adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=t.grad_clip,
                           bf16=formats.weights == "bfloat16", params_dtype=DTYPES[formats.weights],
                           use_distributed_optimizer=formats.sharded, decoupled_weight_decay=True)


def ddp_config(formats: precision.Formats):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=formats.grads == "float32", overlap_grad_reduce=True,
                                         use_distributed_optimizer=formats.sharded,
                                         check_for_nan_in_grad=False)  # kdexp's NonFiniteGuard decides


def apply_weight_decay(param_groups: list[dict], weight_decay: float) -> None:
    """megatron marks the no-decay groups (norms, biases: 1-D) with wd_mult=0 and leaves the product to its
    OptimizerParamScheduler, which kdexp does not use (its lr schedule is kdexp.train.optim.lr_at): set it here."""
    for group in param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


class MegatronOptimizer:
    """The student wrapped in megatron's DDP and its optimizer, behind the few calls the loop makes."""

    def __init__(self, student: torch.nn.Module, t, formats: precision.Formats):
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer

        self.ddp = DistributedDataParallel(config=student.config, ddp_config=ddp_config(formats), module=student)
        self.inner = get_megatron_optimizer(optimizer_config(t, formats), [self.ddp])
        apply_weight_decay(self.inner.param_groups, t.weight_decay)
        self.distributed = formats.sharded
        self.clip = t.grad_clip

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad_buffer()
        self.inner.zero_grad(set_to_none=set_to_none)

    def micro_context(self, index: int, count: int):
        """All but the last micro-batch accumulate without reducing; the last one's backward starts the buckets."""
        return self.ddp.no_sync() if index < count - 1 else contextlib.nullcontext()

    def reduce_and_clip(self) -> torch.Tensor:
        """Finish the DP reduction, copy grads to the fp32 main params and clip them: the norm before clipping."""
        self.ddp.finish_grad_sync()
        distributed.sum_grads_over_tp(self.ddp.parameters())  # finalize_model_grads' TP step (norm weights)
        found_inf = self.inner.prepare_grads()
        if found_inf:
            return torch.tensor(float("inf"))
        norm = self.inner.clip_grad_norm(self.clip) if self.clip > 0 else self.inner.get_grad_norm()
        return torch.tensor(float(norm))

    def step(self) -> None:
        self.inner.step_with_ready_grads()

    @property
    def master_params(self) -> list[torch.Tensor]:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def _parts(self) -> list:
        # get_megatron_optimizer returns a ChainedOptimizer (dense + expert parts); the DP-zero state is per part
        return list(getattr(self.inner, "chained_optimizers", [self.inner]))

    def state_dict(self) -> dict[str, Any]:
        out = {"optimizer": self.inner.state_dict()}
        if self.distributed:  # collective over DP: every rank calls it, DP rank 0 holds the whole state
            out["param_state"] = [part.get_parameter_state_dp_zero() for part in self._parts()]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["optimizer"])
        if self.distributed:
            for part, saved in zip(self._parts(), state["param_state"]):
                part.load_parameter_state_from_dp_zero(saved)
