"""The student's rollouts as a source of training tokens (rollout=on_policy), their loss and the on-policy eval metric.

- ``Rollouts``: built once per run from cfg.rollout (kdexp.objective.build). ``on_policy(step)`` says whether a step
  trains on the student's samples (the schedule's one home is kdexp.config.rollout.on_policy_step, which the cost
  record reads too): a function of the step alone, every micro-batch of a step alike.
  ``sample(student, batch, step)``: the first rollout.prompt_tokens tokens of each dataset sample are the prompt, or
  with rollout.prompts the file's prompts (tokenised by kdexp.data.prompts): global sample i takes line i mod lines,
  a function of the sample index alone (neither the data-parallel size nor the batch moves it); the
  student continues them (kdexp.models.generate: eval mode, no grad, KV cache) with one random stream per global
  sample index and step (kdexp.models.rollout_seeds), stopping at the tokenizer's eos or max_new_tokens. The batch
  it returns trains on the generated tokens only: loss_mask is 0 on the prompt and after a row stopped.
- ``rollout_loss``: the loss of one rollout micro-batch through the objective's head (fused or whole logits), KD only
  (the student's own tokens are no LM target): estimator ``distribution`` is the run's KD term (the loss group's
  divergence and cut) at every generated position; ``sampled_token`` is the per-token reverse KL estimated on the
  sampled token y, advantage A = log p_T(y) - log p_S(y) (discount 0, no gradient), loss -(p_S(y) / q(y)) A with
  p_S recomputed by this forward and q the sampler's log-prob (the importance ratio p_S / q is 1 when the sampler's
  temperature is 1 and top-p 1, up to the forward's rounding). Either way RolloutStats reports, per generated token,
  the student's and the teacher's log-prob of y and the student's entropy.
- ``onpolicy_reverse_kl``: the eval metric val/onpolicy_reverse_kl: the exact full-vocabulary KL(student || teacher)
  per token on the student's own continuations of the validation prompts (a fixed stream: the same draws at every
  eval of a run and across runs of one seed). These are the validation samples' starts even with rollout.prompts,
  so that on- and off-policy runs (which have no prompt file) compare on the same prompts.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from kdexp import distributed, models
from kdexp.config.rollout import on_policy_step
from kdexp.losses import logits_kd_loss
from kdexp.losses.chunking import head_rows
from kdexp.losses.head import ChunkLoss
from kdexp.objective.sources import forward
from kdexp.objective.tokens import cross_entropy

# the "step" of val/onpolicy_reverse_kl's sampler streams: one fixed stream per validation sample, apart from every
# training step's (steps are < 2**62)
EVAL_STREAM = (1 << 62) + 1


class RolloutStats(NamedTuple):
    """Per generated token ([c] each, token-weighted means in the logs as rollout/<field>; None: not reported): the
    KD term's own stats (distribution), log p_S(y) and log p_T(y) of the sampled token at T=1, the student's entropy,
    and (sampled_token) the importance ratio p_S(y) / q(y) and its square (for its spread)."""

    kept_mass: Optional[torch.Tensor] = None
    ghost_mass: Optional[torch.Tensor] = None
    nucleus_size: Optional[torch.Tensor] = None
    student_logprob: Optional[torch.Tensor] = None
    teacher_logprob: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    importance_ratio: Optional[torch.Tensor] = None
    importance_ratio_sq: Optional[torch.Tensor] = None


class Rollouts:
    """The rollout config of a run, the tokenizer's eos id (None: rows stop at max_new_tokens only) and the prompts of
    rollout.prompts ([lines, prompt_tokens]; None: the dataset samples' starts)."""

    def __init__(self, rollout_cfg, *, seed: int, eos_id: Optional[int], prompts: Optional[torch.Tensor] = None):
        r = rollout_cfg
        self.name, self.estimator = str(r.name), str(r.estimator)
        self.prompt_tokens, self.max_new_tokens = int(r.prompt_tokens), int(r.max_new_tokens)
        self.temperature, self.top_p = float(r.temperature), float(r.top_p)
        self.seed, self.eos_id = int(seed), eos_id
        if prompts is not None and (prompts.dim() != 2 or prompts.shape[1] != self.prompt_tokens or not len(prompts)):
            raise ValueError(f"prompts must be [lines >= 1, rollout.prompt_tokens={self.prompt_tokens}], got "
                             f"{list(prompts.shape)}")
        self.prompts = prompts
        self._cfg = rollout_cfg

    @property
    def enabled(self) -> bool:
        return self.name == "on_policy"

    def on_policy(self, step: int) -> bool:
        """Whether training step `step` (0-based) trains on the student's samples (kdexp.config.on_policy_step)."""
        return on_policy_step(self._cfg, step)

    def sample_starts(self, batch: dict) -> torch.Tensor:
        """The first p tokens of each dataset sample of a micro-batch, [b, p]."""
        return batch["tokens"][:, :self.prompt_tokens].contiguous()

    def prompts_of(self, batch: dict) -> torch.Tensor:
        """The [b, p] prompts of a training micro-batch: line (sample index mod lines) of rollout.prompts, or the
        first p tokens of each dataset sample."""
        if self.prompts is None:
            return self.sample_starts(batch)
        rows = batch["sample_index"].to(torch.int64).cpu() % self.prompts.shape[0]
        return self.prompts[rows].to(batch["tokens"].device)

    def sample(self, student, batch: dict, step: int) -> dict:
        """The student's continuations of a training micro-batch's prompts (prompts_of) as a training micro-batch
        (continue_prompts)."""
        return self.continue_prompts(student, self.prompts_of(batch), batch["sample_index"], step)

    @torch.no_grad()
    def continue_prompts(self, student, prompts: torch.Tensor, sample_index: torch.Tensor, step: int) -> dict:
        """The student's continuations of prompts [b, p] as a training micro-batch: tokens / labels / loss_mask
        [b, p + n - 1] (loss_mask 1 at the generated tokens), sample_index, sampler_logprobs [b, p + n - 1] aligned
        with the labels (0 off the generated tokens), lengths [b] and truncated [b]; one random stream per (step,
        global sample index)."""
        seeds = models.rollout_seeds(self.seed, step, sample_index.tolist()).to(prompts.device)
        r = models.generate(student, prompts, max_new_tokens=self.max_new_tokens, seeds=seeds,
                            temperature=self.temperature, top_p=self.top_p, eos_id=self.eos_id)
        p = self.prompt_tokens
        logq = torch.zeros(r.tokens.shape[0], r.tokens.shape[1] - 1, dtype=torch.float32, device=prompts.device)
        logq[:, p - 1:] = r.sampler_logprobs.float()
        return {"tokens": r.tokens[:, :-1], "labels": r.tokens[:, 1:], "loss_mask": r.generated[:, 1:].float(),
                "sample_index": sample_index, "sampler_logprobs": logq, "lengths": r.lengths,
                "truncated": r.truncated}


def entropy(z: torch.Tensor) -> torch.Tensor:
    """The softmax entropy [c] of vocabulary-sharded logits z [c, V/tp] (masked ids at -inf), equal on every TP
    rank."""
    z = z.detach().float()
    group = distributed.tp_group() if distributed.state().tp_size > 1 else None
    m = z.max(-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m[:, None])
    sums = torch.stack([e.sum(-1), torch.where(e > 0, e * z, torch.zeros_like(e)).sum(-1)])
    if group is not None:
        dist.all_reduce(sums, group=group)
    return m + torch.log(sums[0]) - sums[1] / sums[0]


def rollout_loss(objective, s_out, t_out, batch: dict, denom, *, seed: int) -> tuple[torch.Tensor, RolloutStats]:
    """(kd, stats) of one rollout micro-batch, token sums over `denom` (the global batch's generated tokens); the
    graph of kd reaches the student (kd.backward() is its gradient)."""
    labels = batch["labels"].reshape(-1)
    mask = batch["loss_mask"].reshape(-1).float()
    logq = batch["sampler_logprobs"].reshape(-1)
    sampled = objective.rollout.estimator == "sampled_token"
    kd_term = objective.term
    side = None if sampled else kd_term.prepare(t_out, seed, labels.device)
    fuse = bool(getattr(kd_term, "fuses_lm", False))

    def loss_fn(z, rows: slice) -> ChunkLoss:
        y = labels[rows]
        logp_s = -cross_entropy(z, y)
        with torch.no_grad():
            logp_t = -cross_entropy(t_out.chunk_logits(rows), y)
            h = entropy(z)
        if sampled:
            ratio = torch.exp(logp_s - logq[rows])
            kd = -ratio * (logp_t - logp_s).detach()
            r = ratio.detach()
            stats = RolloutStats(student_logprob=logp_s.detach(), teacher_logprob=logp_t, entropy=h,
                                 importance_ratio=r, importance_ratio_sq=r * r)
        else:
            c = kd_term.chunk(z, side, rows, y if fuse else None)
            kd, term = c.kd, c.stats
            stats = RolloutStats(*(None if term is None else term), student_logprob=logp_s.detach(),
                                 teacher_logprob=logp_t, entropy=h)
        return ChunkLoss(kd, -logp_s, stats)  # lm: weight 0 (coefficients), reported by no one

    kd, _, stats = objective._apply(loss_fn, s_out, mask, denom, (1.0, 0.0))
    return kd, stats


@torch.no_grad()
def onpolicy_reverse_kl(objective, student, micros: list[dict]) -> torch.Tensor:
    """val/onpolicy_reverse_kl of one eval item (its micro-batches): the student (in eval mode) continues each
    sample's prompt with the fixed eval stream; the token-weighted mean over the generated tokens of the exact
    full-vocabulary KL(student || teacher) at T=1, chunked like training."""
    rollout = objective.rollout
    rolled = [rollout.continue_prompts(student, rollout.sample_starts(b), b["sample_index"], EVAL_STREAM)
              for b in micros]
    denom = torch.stack([b["loss_mask"].sum() for b in rolled]).sum().clamp(min=1.0)
    total = torch.zeros((), dtype=torch.float64, device=denom.device)
    for b in rolled:
        s = forward(student, b["tokens"], fused=objective.fused)
        t = objective.eval_teacher(b)
        mask = b["loss_mask"].reshape(-1)
        n = s.tokens
        rows_per = n if s.weight is None else head_rows(n, s.weight.shape[0], s.weight.dtype)
        for lo in range(0, n, rows_per):
            rows = slice(lo, min(n, lo + rows_per))
            kl = logits_kd_loss(s.chunk_logits(rows), t.chunk_logits(rows), top_k=None, top_p=None,
                                ghost_token=False, divergence="reverse_kl", tp_group=distributed.tp_group())
            total = total + (kl.double() * mask[rows]).sum()
    return (total / denom).float()
