"""The KD objective: built once per run from the loss and teacher config (``build``), called the same way by the
train step, evaluation and the benchmarks.

The rooms:
- ``sources``: where the teacher's side of a batch comes from (``TEACHERS``: the online teacher model, an offline
  cache) and a model's output as the objective reads it (``ModelOut``, ``forward``).
- ``terms``: the KD term interface (``KDTerm``), one term per loss family x teacher kind, and the registry
  (``LOSSES``, ``register_loss``; the loss names are kdexp.losses.options.LOSS_NAMES) that maps a config to one.
  Nothing outside these tables branches on the loss or the teacher kind.
- ``tokens``: per-token quantities (the one cross-entropy, token normalisation, hidden-state losses, eval metrics).
- ``rollout``: the student's own samples as a source of training tokens (rollout=on_policy), their loss (estimator
  distribution or sampled_token) and the eval metric val/onpolicy_reverse_kl.

The objective owns the output layer: with the fused head (``loss.fused_head``, the rule in
kdexp.losses.head.uses_fused_head) the student's final hidden states and output weight go to
kdexp.losses.head.fused_head_loss, which forms the logits chunk by chunk (never [tokens, vocab] at once), and the
online teacher's chunk logits are formed the same way from its own hidden states and weight, under no_grad. Without
it (the reference path) the models' vocab-parallel logits are formed whole and the term's ``chunk`` runs once over
all tokens. Token normalisation as Megatron's: per-token values weighed by loss_mask / denom (``tokens``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from kdexp import distributed
from kdexp.data import tokenize_prompts
from kdexp.losses import BalancerOptions
from kdexp.losses.chunking import head_rows
from kdexp.losses.head import ChunkLoss, fused_head_loss, uses_fused_head
from kdexp.objective.rollout import Rollouts, RolloutStats, onpolicy_reverse_kl, rollout_loss
from kdexp.objective.sources import TEACHERS, CachedTeacher, ModelOut, OnlineTeacher, forward
from kdexp.objective.terms import LOSSES, CachedLogitTerm, LossOptions, CachedSampledTerm, KDTerm, LogitTerm, \
    SampledTerm, TermStats, family, register_loss, term
from kdexp.objective.tokens import INTERMEDIATE_ATTR, attach_intermediate, cross_entropy, full_kl, \
    intermediate_layers, intermediate_loss, lm_loss, masked_mean, token_share, top1_agreement, vocab_parallel_argmax

__all__ = [
    "Objective", "ObjectiveResult", "build", "build_balancer", "ChunkLoss",
    "Rollouts", "RolloutStats", "onpolicy_reverse_kl", "rollout_loss",
    "TEACHERS", "CachedTeacher", "ModelOut", "OnlineTeacher", "forward",
    "LOSSES", "LossOptions", "CachedLogitTerm", "CachedSampledTerm", "KDTerm", "LogitTerm", "SampledTerm", "TermStats",
    "family", "register_loss", "term",
    "INTERMEDIATE_ATTR", "attach_intermediate", "cross_entropy", "full_kl", "intermediate_layers",
    "intermediate_loss", "lm_loss", "masked_mean", "token_share", "top1_agreement", "vocab_parallel_argmax",
]


class _EvalStats(NamedTuple):
    top1: torch.Tensor  # 1 where the student's and the teacher's argmax agree


class ObjectiveResult(NamedTuple):
    """The student side of one micro-batch: token-normalised scalars. lm is None when the balancer does not need
    it (it is then in `lm_logged`, detached); intermediate is the hidden-state loss (None without loss.intermediate);
    stats the term's TermStats (token-normalised; empty when the term reports none)."""

    kd: torch.Tensor
    lm: Optional[torch.Tensor]
    lm_logged: torch.Tensor
    intermediate: Optional[torch.Tensor]
    stats: TermStats


class Objective:
    """Built once by `build`; per micro-batch: `teacher(batch)`, `student(model, batch)`, then
    `__call__(student_out, teacher_out, batch, denom, seed, needs_lm)` -> ObjectiveResult."""

    def __init__(self, loss_cfg, teacher_source, term: KDTerm, *, fused: bool, fuses_lm: bool, coefficients=None,
                 eval_teacher=None, student_layers=(), pairs=(), rollout: Optional[Rollouts] = None):
        self.loss_cfg, self.teacher, self.term = loss_cfg, teacher_source, term
        self.rollout = rollout  # the rollout config (kdexp.objective.rollout); None: no rollouts, no on-policy eval
        self.fused, self.fuses_lm, self.coefficients = fused, fuses_lm, coefficients
        self.eval_teacher = eval_teacher
        self.student_layers, self.pairs = list(student_layers), list(pairs)

    def student(self, model, batch: dict) -> ModelOut:
        out = forward(model, batch["tokens"], fused=self.fused, layers=self.student_layers)
        out.model = model
        return out

    def _apply(self, loss_fn, out: ModelOut, mask, denom, coefficients=None) -> tuple:
        """(kd, lm, stats) token-normalised: through the fused head, or `loss_fn` once over the whole logits."""
        if self.fused:
            if out.vocab_mask is not None:  # the padded columns -inf before the loss sees them (gradient 0 there)
                loss_fn = _masked_chunks(loss_fn, out)
            r = fused_head_loss(out.hidden, out.weight, loss_fn, token_weight=mask / denom,
                                coefficients=coefficients, tp_group=distributed.tp_group())
            return r.kd, r.lm, r.stats
        n = out.tokens
        c = loss_fn(out.logits.reshape(n, -1), slice(0, n))
        mean = masked_mean
        return (mean(c.kd, mask, denom), None if c.lm is None else mean(c.lm, mask, denom),
                None if c.stats is None else type(c.stats)(*(None if v is None else mean(v.detach(), mask, denom)
                                                             for v in c.stats)))

    def __call__(self, s: ModelOut, t: ModelOut, batch: dict, denom, *, seed: int = 0,
                 needs_lm: bool = True) -> ObjectiveResult:
        labels = batch["labels"].reshape(-1)
        mask = batch["loss_mask"].reshape(-1)
        side = self.term.prepare(t, seed, labels.device)
        fuse, kd_term = self.fuses_lm, self.term

        def loss_fn(z, rows: slice) -> ChunkLoss:
            lab = labels[rows]
            c = kd_term.chunk(z, side, rows, lab if fuse else None)
            if c.lm is not None:
                return c
            if needs_lm:
                return c._replace(lm=cross_entropy(z, lab))
            with torch.no_grad():  # alpha == 1: logged only, out of the graph
                return c._replace(lm=cross_entropy(z.detach(), lab))

        kd, lm, stats = self._apply(loss_fn, s, mask.float(), denom, self.coefficients)
        inter = None
        if self.pairs:
            inter = intermediate_loss(s.model, self.loss_cfg, s.layers, t.layers, batch["loss_mask"], denom)
        if stats is not None and not isinstance(stats, TermStats):
            raise ValueError(f"{type(kd_term).__name__}.chunk returned stats of type {type(stats).__name__}: must be "
                             "None or kdexp.objective.TermStats")
        return ObjectiveResult(kd, lm if needs_lm else None, lm.detach(), inter,
                               TermStats() if stats is None else stats)

    @torch.no_grad()
    def evaluate(self, model, batch: dict, denom) -> torch.Tensor:
        """[val/kl_to_teacher, val/top1_agreement, val/lm_loss] of one micro-batch (token sums over `denom`), always
        against the teacher model (full-vocabulary forward KL at T=1), chunked like training."""
        from kdexp.losses import logits_kd_loss

        s = forward(model, batch["tokens"], fused=self.fused)
        t = self.eval_teacher(batch)
        labels = batch["labels"].reshape(-1)

        def loss_fn(z, rows: slice) -> ChunkLoss:
            tz = t.chunk_logits(rows)
            kl = logits_kd_loss(z, tz, top_k=None, top_p=None, ghost_token=False, tp_group=distributed.tp_group())
            same = (vocab_parallel_argmax(z) == vocab_parallel_argmax(tz)).float()
            return ChunkLoss(kl, cross_entropy(z, labels[rows]), _EvalStats(same))

        mask = batch["loss_mask"].reshape(-1).float()
        if self.fused:
            kl, lm, stats = _eval_chunks(loss_fn, s, mask / denom)
        else:
            kl, lm, stats = self._apply(loss_fn, s, mask, denom)
        return torch.stack([kl, stats.top1, lm])


def _masked_chunks(loss_fn, out: ModelOut):
    return lambda z, rows: loss_fn(out.masked(z), rows)


def _eval_chunks(loss_fn, out: ModelOut, token_weight) -> tuple:
    """No-grad fused evaluation: each chunk's logits formed from the hidden states, used, dropped (the head's chunk
    rule, the same on every TP rank)."""
    kd = lm = top1 = torch.zeros((), device=token_weight.device)
    n = out.tokens
    rows_per = head_rows(n, out.weight.shape[0], out.weight.dtype)
    for lo in range(0, n, rows_per):
        rows = slice(lo, min(n, lo + rows_per))
        z = out.chunk_logits(rows)
        c = loss_fn(z, rows)
        w = token_weight[rows]
        kd, lm = kd + (c.kd.float() * w).sum(), lm + (c.lm.float() * w).sum()
        top1 = top1 + (c.stats.top1.float() * w).sum()
    return kd, lm, _EvalStats(top1)


def build_balancer(balancer_cfg):
    """The balancer a config's `balancer` node describes (its value rules checked first)."""
    return BalancerOptions.from_config(balancer_cfg).build()


def build(cfg, data, teacher_model, balancer, *, identify_teacher: Optional[Callable[[], dict]] = None,
          prompts: Optional[torch.Tensor] = None) -> Objective:
    """The run's objective from cfg.loss and cfg.teacher: the teacher source (TEACHERS), the loss term (LOSSES),
    whether the head is fused (loss.fused_head: kdexp.losses.head.uses_fused_head), the balancer's fixed coefficients
    (the head's gradients in the forward pass) and the hidden-state pairs. ``identify_teacher()``: what names the
    teacher's weights (kdexp.train.teacher.teacher_identity), for a source keyed by them (the cache). ``prompts``:
    rollout.prompts tokenised (kdexp.data.prompts, before the models are built); tokenised here when not given."""
    loss_cfg = cfg.loss
    spec = getattr(teacher_model, "kdexp_spec", None)  # the padded vocabulary the plan sizes (one tokenizer)
    vocab = spec.vocab_size if spec is not None else data.vocab_size
    fused = uses_fused_head(loss_cfg.fused_head, int(cfg.trainer.micro_batch_size) * int(cfg.trainer.seq_length),
                            -(-vocab // int(cfg.parallel.tensor)))
    s_layers, t_layers = intermediate_layers(loss_cfg)
    loss = LossOptions.parse(loss_cfg)  # the one parse of the loss options in a run
    source = TEACHERS[cfg.teacher.name](cfg, data, teacher_model, fused=fused, layers=t_layers, opts=loss.kd,
                                         identify=identify_teacher)
    kd_term = term(loss, source)
    coefficients = getattr(balancer, "coefficients", None) if not s_layers else None
    if prompts is None and cfg.rollout.prompts is not None:
        prompts = tokenize_prompts(cfg.rollout.prompts, data.tokenizer, int(cfg.rollout.prompt_tokens))
    return Objective(loss_cfg, source, kd_term, fused=fused, fuses_lm=bool(getattr(kd_term, "fuses_lm", False)),
                     coefficients=coefficients, eval_teacher=OnlineTeacher(teacher_model, fused=fused),
                     student_layers=s_layers, pairs=loss_cfg.intermediate or [],
                     rollout=Rollouts(cfg.rollout, seed=int(cfg.trainer.seed), eos_id=_eos(data), prompts=prompts))


def _eos(data) -> Optional[int]:
    """The tokenizer's end-of-sequence id, where rollouts stop (None for a data stand-in without a tokenizer)."""
    tokenizer = getattr(data, "tokenizer", None)
    return None if tokenizer is None else int(tokenizer.eos)
