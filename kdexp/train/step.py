"""One training step, evaluation, and the non-finite guard that stands between a step's gradients and the weights.

The guard reads one scalar to the host per step (is the loss and the gradient norm finite, agreed over all ranks)
before the optimizer may touch the weights. A non-finite step is skipped (gradients dropped, no update) while
``trainer.skip_nonfinite`` allows, else the run stops with ``Diverged``; eval metrics and the weights/optimizer state
written to a checkpoint are checked too, so a diverged run never saves non-finite state.
"""
from __future__ import annotations

import logging
import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from kdexp import distributed, models
from kdexp.train import objectives
from kdexp.train.errors import Diverged

log = logging.getLogger("kdexp")


def train_step(student, teacher, batch, balancer, cfg, needs_lm: bool, step: int = 0) -> dict[str, torch.Tensor]:
    """Forward both models, the balanced loss, backward; the detached parts for logging (no host sync).
    `step` (0-based) seeds sampled KD's draws."""
    s_layers, t_layers = objectives.intermediate_layers(cfg.loss)
    with torch.no_grad(), models.capture_hidden(teacher, t_layers) as t_hidden:
        t_logits = models.vocab_parallel_logits(teacher, batch["tokens"])
    with models.capture_hidden(student, s_layers) as s_hidden:
        s_logits = models.vocab_parallel_logits(student, batch["tokens"])
    mask = batch["loss_mask"]
    kd, stats = objectives.kd_loss(s_logits, t_logits, mask, cfg.loss, seed=objectives.sampling_seed(cfg, step))
    inter = objectives.intermediate_loss(student, cfg.loss, s_hidden, t_hidden, mask) if s_layers else None
    if inter is not None:
        stats["intermediate_loss"] = inter
    if needs_lm:
        lm = objectives.lm_loss(s_logits, batch["labels"], mask)
    else:  # alpha == 1: the LM loss stays out of the graph; logged from a detached copy
        with torch.no_grad():
            lm_logged = objectives.lm_loss(s_logits.detach(), batch["labels"], mask)
        lm = None
    total, _ = balancer(lm, kd, inter)  # the intermediate loss joins the KD term rescaled to |kd|
    total.backward()
    return {"train/loss": total.detach(), "train/lm_loss": (lm if lm is not None else lm_logged).detach(),
            "train/kd_loss": kd.detach(), **{f"train/{k}": v.detach() for k, v in stats.items()}}


@torch.no_grad()
def evaluate(student, teacher, val_batches: list[dict]) -> dict[str, float]:
    """val/lm_loss, val/kl_to_teacher (full-vocabulary forward KL, T=1), val/top1_agreement; averaged over DP."""
    st = distributed.state()
    student.eval()
    sums = torch.zeros(3, device=st.device)
    for batch in val_batches:
        t_logits = models.vocab_parallel_logits(teacher, batch["tokens"])
        s_logits = models.vocab_parallel_logits(student, batch["tokens"])
        mask = batch["loss_mask"]
        sums += torch.stack([objectives.full_kl(s_logits, t_logits, mask),
                             objectives.top1_agreement(s_logits, t_logits, mask),
                             objectives.lm_loss(s_logits, batch["labels"], mask)])
    student.train()
    if st.dp_size > 1:
        dist.all_reduce(sums, group=distributed.dp_group())
        sums /= st.dp_size
    kl, agree, lm = (sums / max(1, len(val_batches))).tolist()
    return {"val/lm_loss": lm, "val/kl_to_teacher": kl, "val/top1_agreement": agree}


def _any_rank(flag: torch.Tensor) -> bool:
    """True when `flag` (a 0-d bool tensor) is set on any rank: the one host read of the step."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def state_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Every floating tensor finite, on every rank (collective when distributed)."""
    bad: Optional[torch.Tensor] = None
    for t in tensors:
        if torch.is_tensor(t) and t.is_floating_point():
            b = ~torch.isfinite(t).all()
            bad = b if bad is None else bad | b
    if bad is None:
        bad = torch.zeros((), dtype=torch.bool, device=distributed.state().device)
    return not _any_rank(bad)


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


class NonFiniteGuard:
    """Decides per step: apply the update, skip it (up to `limit` times in the run), or stop with Diverged."""

    def __init__(self, limit: int, skipped: int = 0):
        if limit < 0:
            raise ValueError(f"trainer.skip_nonfinite={limit} must be >= 0")
        self.limit = limit
        self.skipped = skipped

    def _stop(self, step: int, what: str, metrics: Optional[dict], checkpoint: Optional[int], *,
              stopped: str) -> Diverged:
        kept = f"last finite checkpoint: step {checkpoint}" if checkpoint is not None else "no checkpoint was saved"
        skipped = (f"; {self.skipped} non-finite step(s) skipped before (trainer.skip_nonfinite={self.limit})"
                   if self.limit else "; trainer.skip_nonfinite=N skips up to N such steps")
        return Diverged(f"diverged at step {step}: {what}; {stopped} ({kept}){skipped}",
                        step=step, metrics=metrics, skipped=self.skipped, checkpoint=checkpoint)

    def check_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, *,
                   metrics: Optional[dict] = None, checkpoint: Optional[int] = None) -> bool:
        """True: apply the update. False: skip this step. Raises Diverged past the skip budget."""
        if not _any_rank(~(torch.isfinite(loss) & torch.isfinite(grad_norm))):
            return True
        values = {"train/loss": loss.item(), "train/grad_norm": grad_norm.item()}
        bad = [k for k, v in values.items() if not math.isfinite(v)]
        what = (f"non-finite {' and '.join(bad)} ({', '.join(f'{k}={v:.6g}' for k, v in values.items())})" if bad
                else "a non-finite train/loss or train/grad_norm on another rank")
        if self.skipped >= self.limit:
            raise self._stop(step, what, metrics, checkpoint, stopped="stopped before the weights changed")
        self.skipped += 1
        if distributed.is_rank0():
            log.warning("step %d: %s; skipped (%d/%d of trainer.skip_nonfinite)", step, what, self.skipped,
                        self.limit)
        return False

    def check_values(self, step: int, values: dict[str, float], what: str, *, metrics: Optional[dict] = None,
                     checkpoint: Optional[int] = None) -> None:
        """Eval metrics: a non-finite one means the weights themselves went bad (nothing to skip)."""
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if bad:
            raise self._stop(step, f"non-finite {what} {bad}", metrics, checkpoint,
                             stopped="stopped after this step's update, before its checkpoint")

    def check_state(self, step: int, tensors: Iterable[torch.Tensor], *, metrics: Optional[dict] = None,
                    checkpoint: Optional[int] = None) -> None:
        """Before a checkpoint: non-finite weights or optimizer state are never saved."""
        if not state_finite(tensors):
            raise self._stop(step, "non-finite weights or optimizer state", metrics, checkpoint,
                             stopped="stopped before saving them")


def apply_update(opt: torch.optim.Optimizer, apply: bool) -> None:
    """The optimizer step, or for a skipped step drop the gradients so nothing of it reaches the weights."""
    if apply:
        opt.step()
    else:
        opt.zero_grad(set_to_none=True)
