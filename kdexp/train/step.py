"""One training step, evaluation, and the non-finite guard that stands between a step's gradients and the weights.

The guard reads one scalar to the host per step (is the loss and the gradient norm finite, agreed over all ranks)
before the optimizer may touch the weights. A non-finite step is skipped (gradients dropped, no update) while
``trainer.skip_nonfinite`` allows, else the run stops with ``Diverged``; eval metrics and the weights/optimizer state
written to a checkpoint are checked too, so a diverged run never saves non-finite state.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from kdexp import distributed, models
from kdexp.objective import lm_loss, onpolicy_reverse_kl, rollout_loss, token_share
from kdexp.train import megatron_optim, optim
from kdexp.train.batches import sampling_seed
from kdexp.train.errors import Diverged

log = logging.getLogger("kdexp")


def _micro_step(student, objective, batch, balancer, needs_lm: bool, denom, seed: int) -> dict[str, torch.Tensor]:
    """One micro-batch: the teacher's side (a forward, or a cache record), the student's forward, the objective, the
    balanced loss, backward. `seed` seeds sampled KD's draws."""
    t_out = objective.teacher(batch)
    s_out = objective.student(student, batch)
    r = objective(s_out, t_out, batch, denom, seed=seed, needs_lm=needs_lm)
    total, _ = balancer(r.lm, r.kd, r.intermediate)  # the intermediate loss joins the KD term rescaled to |kd|
    total.backward()
    out = {"train/loss": total.detach(), "train/lm_loss": r.lm_logged, "train/kd_loss": r.kd.detach(),
           **r.stats.logged("train/")}
    if r.intermediate is not None:
        out["train/intermediate_loss"] = r.intermediate.detach()
    return out


def train_step(student, objective, micro_batches, balancer, cfg, needs_lm: bool, step: int = 0,
               micro_context=None) -> dict[str, torch.Tensor]:
    """Forward both models, the balanced loss and backward for each micro-batch of one global batch (gradients
    accumulate in .grad); the detached parts of the global batch for logging (no host sync).

    Every loss and stat is a token sum over the tokens of the whole global batch (kdexp.objective.token_share), so the
    micro-batches' parts add up to the global-batch means and the accumulated gradient is the gradient of the
    global-batch loss: micro 2 x 4 accumulation steps is micro 8 x 1. (The dynamic balancer's LM/KD ratio is taken
    per micro-batch, as ModelOpt's is under megatron.) With DP > 1 the logged parts are the average over the
    data-parallel ranks (one small all_reduce), i.e. the values of the whole global batch. `micro_context(i, n)`:
    a context for micro-batch i of n (megatron DDP's no_sync for all but the last). `step` (0-based) seeds sampled
    KD's draws (kdexp.train.batches.sampling_seed, per micro-batch)."""
    if isinstance(micro_batches, dict):
        micro_batches = [micro_batches]
    rollout = getattr(objective, "rollout", None)
    if rollout is not None and rollout.on_policy(step):
        return _on_policy_step(student, objective, micro_batches, cfg, step, micro_context)
    st = distributed.state()
    denom = token_share(micro_batches, distributed.dp_group(), st.dp_size)
    parts: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro_batches):
        with micro_context(i, len(micro_batches)) if micro_context else contextlib.nullcontext():
            micro = _micro_step(student, objective, batch, balancer, needs_lm, denom,
                                sampling_seed(cfg, step, i))
        _add(parts, micro)
    if rollout is not None and rollout.enabled:
        parts["rollout/on_policy_fraction"] = torch.zeros((), device=st.device)
    return _dp_mean(parts)


def _add(parts: dict, micro: dict) -> None:
    for key, value in micro.items():
        parts[key] = parts[key] + value if key in parts else value


def _dp_mean(parts: dict) -> dict:
    """The logged parts averaged over the data-parallel ranks (one small all_reduce): the global batch's values."""
    st = distributed.state()
    if st.dp_size > 1:
        keys = list(parts)
        flat = torch.stack([parts[k].float() for k in keys])
        dist.all_reduce(flat, group=distributed.dp_group())
        parts = dict(zip(keys, flat / st.dp_size))
    return parts


def rollout_micro_batches(student, objective, micro_batches: list[dict], step: int) -> list[dict]:
    """The student's continuations of each micro-batch's prompts (kdexp.objective.Rollouts.sample)."""
    return [objective.rollout.sample(student, batch, step) for batch in micro_batches]


def _on_policy_step(student, objective, micro_batches, cfg, step: int, micro_context=None) -> dict:
    """A step on the student's own samples: generate every micro-batch's rollouts first (the token normalisation
    counts the generated tokens of the whole global batch), then per micro-batch the teacher's scoring, the student's
    forward, the rollout loss (KD only) and backward. Logged: train/loss and rollout/* (the estimator's loss as
    rollout/kd_loss; per generated token the stats of kdexp.objective.RolloutStats; per sample the length and the
    truncated fraction; the importance ratio's mean and standard deviation with estimator=sampled_token)."""
    rolled = rollout_micro_batches(student, objective, micro_batches, step)
    return on_policy_update(student, objective, rolled, cfg, step, micro_context)


def on_policy_update(student, objective, rolled: list[dict], cfg, step: int, micro_context=None,
                     scored: Optional[list] = None) -> dict:
    """Teacher scoring, student forward, rollout loss and backward of a step's rollouts (see _on_policy_step).
    `scored`: the teacher's outputs on `rolled`, computed beforehand (the step benchmark times the scoring apart)."""
    st = distributed.state()
    denom = token_share(rolled, distributed.dp_group(), st.dp_size)
    samples = float(sum(b["lengths"].numel() for b in rolled))
    parts: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(rolled):
        with micro_context(i, len(rolled)) if micro_context else contextlib.nullcontext():
            t_out = objective.teacher(batch) if scored is None else scored[i]
            s_out = objective.student(student, batch)
            kd, stats = rollout_loss(objective, s_out, t_out, batch, denom, seed=sampling_seed(cfg, step, i))
            kd.backward()
        _add(parts, {"train/loss": kd.detach(), "rollout/kd_loss": kd.detach(),
                     **{f"rollout/{k}": v.detach() for k, v in stats._asdict().items() if v is not None},
                     "rollout/length": batch["lengths"].float().sum() / samples,
                     "rollout/truncated_fraction": batch["truncated"].float().sum() / samples})
    parts["rollout/on_policy_fraction"] = torch.ones((), device=st.device)
    parts = _dp_mean(parts)
    square = parts.pop("rollout/importance_ratio_sq", None)
    if square is not None:
        mean = parts["rollout/importance_ratio"]
        parts["rollout/importance_ratio_std"] = (square - mean * mean).clamp(min=0).sqrt()
    return parts


@torch.no_grad()
def evaluate(student, objective, val_batches: list) -> dict[str, float]:
    """val/lm_loss, val/kl_to_teacher (full-vocabulary forward KL, T=1), val/top1_agreement and
    val/onpolicy_reverse_kl (kdexp.objective.onpolicy_reverse_kl: the exact reverse KL per token on the student's own
    continuations of the validation prompts; not under sequence parallelism); averaged over DP.

    Each item of `val_batches` is one eval iteration: a micro-batch, or a list of the micro-batches of this rank's
    share of one global batch (token-normalised over that share, as in training). Always against the teacher model
    (also when training reads a cache), formed chunk by chunk when the objective fuses the head."""
    st = distributed.state()
    student.eval()
    # generation has no sequence-parallel path (one token per row to split over the TP ranks): such a run has no
    # val/onpolicy_reverse_kl (and rollout=on_policy refuses parallel.sequence)
    on_policy = getattr(objective, "rollout", None) is not None and not models.sequence_parallel(student)
    sums = torch.zeros(4, device=st.device)
    for item in val_batches:
        micros = [item] if isinstance(item, dict) else item
        denom = token_share(micros)
        for batch in micros:
            sums[:3] += objective.evaluate(student, batch, denom)
        if on_policy:
            sums[3] += onpolicy_reverse_kl(objective, student, micros).to(sums.device)
    student.train()
    if st.dp_size > 1:
        dist.all_reduce(sums, group=distributed.dp_group())
        sums /= st.dp_size
    kl, agree, lm, reverse = (sums / max(1, len(val_batches))).tolist()
    out = {"val/lm_loss": lm, "val/kl_to_teacher": kl, "val/top1_agreement": agree}
    if on_policy:
        out["val/onpolicy_reverse_kl"] = reverse
    return out


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
    """The optimizer's state tensors, and the fp32 master weights of a mixed-precision one."""
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return state + list(getattr(opt, "master_params", []))


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


def reduce_and_clip(student, opt, max_norm: float) -> torch.Tensor:
    """After a global batch's backward passes: the DP reduction (once per step) and clipping, on the fp32 gradients
    of whichever optimizer path runs; the norm before clipping, on this rank's device."""
    if isinstance(opt, megatron_optim.MegatronOptimizer):
        return opt.reduce_and_clip().to(distributed.state().device)
    grads = optim.grad_params(student, opt)  # the fp32 masters' grads under bf16
    optim.average_gradients(grads)
    return optim.clip_gradients(grads, max_norm)


def apply_update(opt: torch.optim.Optimizer, apply: bool) -> None:
    """The optimizer step, or for a skipped step drop the gradients so nothing of it reaches the weights."""
    if apply:
        opt.step()
    else:
        opt.zero_grad(set_to_none=True)


def optimizer_step(model, optimizer, forward_backward: Callable[[], dict], *, grad_clip: float,
                   guard: NonFiniteGuard, done: int, metrics=None, checkpoint=None) -> tuple[dict, bool]:
    """The one optimizer-step sequence: zero the gradients, `forward_backward()` (one global batch's forward and
    backward; returns the logged parts, "train/loss" among them), the DP reduction and clipping, the non-finite
    guard's one host read for step `done` (1-based), the update (or a skipped step). The distillation step, the
    benchmarks' LM-only baseline and the embedded teacher's pretraining all run it. Returns (the logged parts with
    "train/grad_norm", whether the update was applied)."""
    optimizer.zero_grad(set_to_none=True)
    parts = forward_backward()
    parts["train/grad_norm"] = reduce_and_clip(model, optimizer, grad_clip)
    finite = guard.check_step(done, parts["train/loss"], parts["train/grad_norm"], metrics=metrics,
                              checkpoint=checkpoint)
    apply_update(optimizer, finite)
    return parts, finite


def lm_backward(model, batch: dict) -> dict:
    """The LM loss alone, forward and backward (a model trained without distillation): {"train/loss": detached}."""
    loss = lm_loss(models.vocab_parallel_logits(model, batch["tokens"]), batch["labels"], batch["loss_mask"])
    loss.backward()
    return {"train/loss": loss.detach()}


class StepDriver:
    """The trainer's and the benchmarks' steps on a set-up run (kdexp.train.loop.setup), each the one sequence of
    `optimizer_step`: `step` distils (train_step over the global batch), `lm_step` trains the student with the LM
    loss alone (the benchmarks' baseline)."""

    def __init__(self, s, cfg, guard: Optional[NonFiniteGuard] = None):
        self.s, self.cfg = s, cfg
        self.guard = guard if guard is not None else NonFiniteGuard(cfg.trainer.skip_nonfinite)

    def _run(self, step: int, forward_backward, metrics=None, checkpoint=None) -> tuple[dict, bool]:
        return optimizer_step(self.s.student, self.s.optimizer, forward_backward, grad_clip=self.cfg.trainer.grad_clip,
                              guard=self.guard, done=step + 1, metrics=metrics, checkpoint=checkpoint)

    def step(self, step: int, micro_batches, *, metrics=None, checkpoint=None) -> tuple[dict, bool]:
        """Training step `step` (0-based): (the logged parts, whether the update was applied)."""
        s = self.s
        return self._run(step, lambda: train_step(
            s.student, s.objective, micro_batches, s.balancer, self.cfg, s.balancer.needs_lm_loss, step=step,
            micro_context=getattr(s.optimizer, "micro_context", None)), metrics, checkpoint)

    def on_policy_update(self, step: int, rolled: list[dict], scored: Optional[list] = None) -> tuple[dict, bool]:
        """The update of an on-policy step on rollouts generated beforehand (rollout_micro_batches) and, optionally,
        the teacher's outputs on them: the step benchmark times generation, scoring and update apart."""
        s = self.s
        return self._run(step, lambda: on_policy_update(
            s.student, s.objective, rolled, self.cfg, step, getattr(s.optimizer, "micro_context", None), scored))

    def lm_step(self, step: int, batch: dict, *, teacher: bool = False) -> tuple[dict, bool]:
        """The student alone with the LM loss: what training without distillation costs; with `teacher` the
        teacher's side of the batch first (its forward, or nothing to run for a cache): what any distillation pays."""
        s = self.s

        def forward_backward() -> dict:
            if teacher:
                s.objective.teacher(batch)
            return lm_backward(s.student, batch)

        return self._run(step, forward_backward)
