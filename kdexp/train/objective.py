"""The KD objective: built once from the loss and teacher config through one registry, called the same way by the
train step, evaluation and the benchmarks.

Two tables hold every choice; nothing outside this module branches on the loss or the teacher kind:

- ``TEACHERS``: teacher.name -> where the teacher's side of a batch comes from: "online" (the frozen teacher model
  runs on the batch) or "cached" (the records of an offline teacher cache, kdexp.teacher, built at setup).
- ``LOSSES``: (family, teacher.name) -> a factory called once with the parsed options, returning a ``KDTerm``:
  ``prepare(teacher_out, seed)`` (the teacher's side of the whole batch: a cache record, the draws) and
  ``chunk(z, side, rows, labels)``, the per-token loss of one chunk of student logits ``z`` [c, V/tp] covering the
  token ``rows``. The family is loss.name's entry of ``FAMILIES`` ("logit" for the shipped logit losses, "sampled"
  whenever loss.samples is set); a new loss registers its name with ``register_loss`` (docs/objective.md, "Adding a loss").

The objective owns the output layer: with ``loss.fused_head`` the student's final hidden states and output weight go
to kdexp.losses.head.fused_head_loss, which forms the logits chunk by chunk (never [tokens, vocab] at once) and the
online teacher's chunk logits are formed the same way from its own hidden states and weight, under no_grad. Without
it (the reference path) the models' vocab-parallel logits are formed whole and the same ``chunk`` runs once over all
tokens. Token normalisation as Megatron's: per-token values weighed by loss_mask / denom (kdexp.train.objectives).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, NamedTuple, Optional

import torch

from kdexp import distributed, models
from kdexp.losses import KDLossOptions, SampledKDOptions
# A term's chunk result: per-token kd [c], lm [c] (None: the objective adds the cross-entropy), stats (TermStats or
# None); the fused head's own type.
from kdexp.losses.head import ChunkLoss, fused_head_loss, head_chunk_rows, teacher_head_logits, tp_copy, \
    uses_fused_head
from kdexp.train import objectives

log = logging.getLogger("kdexp")


class TermStats(NamedTuple):
    """Per-token statistics of the KD term on a chunk ([c] each; None: not reported), logged as train/<field> (their
    token-weighted means): the teacher's mass the term keeps (the cut's, or the sampled draws' distinct ids), the
    student's mass on the ghost token (outside the kept ids), and how many ids the term keeps."""

    kept_mass: Optional[torch.Tensor] = None
    ghost_mass: Optional[torch.Tensor] = None
    nucleus_size: Optional[torch.Tensor] = None

    def logged(self, prefix: str) -> dict:
        return {f"{prefix}{k}": v.detach() for k, v in self._asdict().items() if v is not None}


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


@dataclasses.dataclass
class ModelOut:
    """One model's output for the objective: `logits` [b, s, V/tp] on the reference path, or the final hidden states
    `hidden` [b*s, H] (tokens in the labels' order, TP region applied) and the output weight [V/tp, H]; `layers` the
    decoder outputs the hidden-state losses read; `sample_index` (a cached teacher) the cache keys."""

    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    layers: dict = dataclasses.field(default_factory=dict)
    sample_index: Any = None
    model: Any = None  # the student (its hidden-state loss modules are attached to it)
    # [V/tp] bool, True at the columns of ids beyond the tokenizer's (model.vocab_alignment=tokenizer): -inf in every
    # chunk formed from `hidden`, as the output layer's hook makes them on the logits path; None: nothing padded here
    vocab_mask: Optional[torch.Tensor] = None

    @property
    def tokens(self) -> int:
        return self.hidden.shape[0] if self.hidden is not None else self.logits[..., 0].numel()

    def chunk_logits(self, rows: slice) -> torch.Tensor:
        """This rank's vocabulary shard of the logits of token `rows` [c, V/tp] (no grad for a teacher)."""
        if self.logits is not None:
            return self.logits.reshape(-1, self.logits.shape[-1])[rows]
        return self.masked(teacher_head_logits(self.hidden, self.weight, rows))

    def all_logits(self):
        """Every token's logits for a reader that goes through them chunk by chunk (sampled KD's draws): the whole
        [n, V/tp] tensor on the reference path, else kdexp.losses.LogitRows over `chunk_logits` (never formed whole)."""
        if self.logits is not None:
            return self.logits.reshape(-1, self.logits.shape[-1])
        from kdexp.losses import LogitRows

        return LogitRows(self.tokens, self.weight.shape[0], self.weight.dtype, self.weight.device, self.chunk_logits)

    def masked(self, z: torch.Tensor) -> torch.Tensor:
        """A chunk formed from the hidden states with the padded columns at -inf (the hook's rule, models.vocab)."""
        return z if self.vocab_mask is None else z.masked_fill(self.vocab_mask, -math.inf)


def forward(model, tokens: torch.Tensor, *, fused: bool, layers=()) -> ModelOut:
    """A model's forward for the objective: its final hidden states + output weight (fused) or its logits."""
    with models.capture_hidden(model, layers) as captured:
        if not fused:
            return ModelOut(logits=models.vocab_parallel_logits(model, tokens), layers=captured)
        hidden, weight = models.final_hidden(model, tokens)
    return ModelOut(hidden=_head_input(model, hidden), weight=weight, layers=captured,
                    vocab_mask=models.padded_vocab_mask(model, weight.shape[0], weight.device))


def _head_input(model, hidden: torch.Tensor) -> torch.Tensor:
    """[s(/tp), b, h] -> [b*s, h] for the head, with the region megatron's ColumnParallelLinear output layer applies
    first: under sequence parallelism its input gathered over the sequence (the backward reduce-scatters the partial
    gradients), else identity forward / all-reduce backward (`tp_copy`), applied after the reshape. Not megatron's
    copy_to_tensor_model_parallel_region here: its backward all-reduces `grad.contiguous()` and returns `grad`, so a
    non-contiguous gradient (what the [s, b, h] -> [b*s, h] transpose hands back) kept this rank's partial sum only,
    and every student gradient at TP > 1 was wrong."""
    tp = distributed.state().tp_size > 1
    sp = tp and models.sequence_parallel(model)
    if sp:
        from megatron.core import tensor_parallel

        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
    return tp_copy(flat, distributed.tp_group()) if tp and not sp else flat


# ----------------------------------------------------------------------------------------------------- teachers

class OnlineTeacher:
    """The frozen teacher model runs on every batch (no grad); its hidden states feed the hidden-state losses."""

    hidden_states = True
    # kdexp.bench.step's rows: what the baseline pays for the teacher, and the KD step
    baseline_label, kd_label = "teacher fwd + student fwd+bwd (LM)", "KD train step (teacher, student, KD+LM)"

    def __init__(self, model, *, fused: bool, layers=()):
        self.model, self.fused, self.layers = model, fused, list(layers)

    @torch.no_grad()
    def __call__(self, batch: dict) -> ModelOut:
        return forward(self.model, batch["tokens"], fused=self.fused, layers=self.layers)


class CachedTeacher:
    """The teacher's records of the batch's samples, read from an offline cache (kdexp.teacher.TeacherCache)."""

    hidden_states = False
    baseline_label, kd_label = "student fwd+bwd (LM only, no teacher)", "KD train step from the teacher cache"

    def __init__(self, cache):
        self.cache = cache

    def __call__(self, batch: dict) -> ModelOut:
        return ModelOut(sample_index=batch["sample_index"])


def _online(cfg, data, model, *, fused: bool, layers=()):
    return OnlineTeacher(model, fused=fused, layers=layers)


def _cached(cfg, data, model, *, fused: bool, layers=()):
    from kdexp.teacher.writer import ensure

    cache = ensure(cfg, data, model)  # one teacher pass into the cache (skipped when it exists)
    opts = KDLossOptions.from_config(cfg.loss)
    if cache.layout.record == "topk" and opts.top_k is None and not opts.dense:  # a nucleus served from top-K_max
        from kdexp.teacher.reader import check_nucleus

        started = time.perf_counter()
        try:
            tokens = check_nucleus(cache, top_p=float(opts.top_p), temperature=float(opts.temperature),
                                   vocab=data.vocab_size)  # every token, before the student exists (ConfigError)
        except ValueError:
            if distributed.is_rank0():
                log.info("stage teacher_cache: nucleus check (loss.top_p=%s, top-%d) took %.2f s", opts.top_p,
                         cache.k_max, time.perf_counter() - started)
            raise
        if distributed.is_rank0():
            log.info("stage teacher_cache: every cached token's nucleus (loss.top_p=%s) fits in its top-%d "
                     "(%d tokens checked in %.2f s)", opts.top_p, cache.k_max, tokens, time.perf_counter() - started)
    return CachedTeacher(cache)


TEACHERS: dict[str, Callable] = {"online": _online, "cached": _cached}


# ------------------------------------------------------------------------------------------------------- losses

def _logit_stats(stats) -> TermStats:
    return TermStats(kept_mass=stats.teacher_kept_mass, ghost_mass=stats.student_residual_mass,
                     nucleus_size=stats.nucleus_size.float())


def _split(out, labels):
    return out if labels is not None else (out, None)


class LogitTerm:
    """The logit KD loss (dense, Top-K, Top-P, ghost, renormalised; kdexp.losses.logits_kd_loss) on the online
    teacher's chunk logits."""

    def __init__(self, opts: KDLossOptions):
        self.kw = opts.kwargs()
        self.fuses_lm = opts.fuses_lm()  # the LM loss from the same pass over the vocabulary (labels=)

    def prepare(self, teacher: ModelOut, seed: int, device) -> ModelOut:
        return teacher

    def chunk(self, z, side: ModelOut, rows: slice, labels) -> ChunkLoss:
        from kdexp.losses import logits_kd_loss

        out, stats = logits_kd_loss(z, side.chunk_logits(rows), tp_group=distributed.tp_group(), return_stats=True,
                                    labels=labels, **self.kw)
        return ChunkLoss(*_split(out, labels), _logit_stats(stats))


class CachedLogitTerm(LogitTerm):
    """The same loss from a cache's top-K_max record (kdexp.losses.cached_kd_loss)."""

    def __init__(self, opts: KDLossOptions, cache):
        super().__init__(opts)
        self.cache, self.temperature = cache, opts.temperature

    def prepare(self, teacher: ModelOut, seed: int, device):
        record = self.cache.read(teacher.sample_index, self.temperature, device=device)
        return [x.flatten(0, 1) for x in record]  # [b, s, ...] -> [n, ...]

    def chunk(self, z, side, rows: slice, labels) -> ChunkLoss:
        from kdexp.losses import cached_kd_loss

        out, stats = cached_kd_loss(z, *(x[rows] for x in side), tp_group=distributed.tp_group(),
                                    return_stats=True, labels=labels, **self.kw)
        return ChunkLoss(*_split(out, labels), _logit_stats(stats))


class SampledTerm:
    """Sampled KD (kdexp.losses.sampled) on draws from the online teacher's logits, seeded per micro-batch."""

    def __init__(self, opts: KDLossOptions, sampled: SampledKDOptions):
        self.opts, self.sampled = opts, sampled
        self.fuses_lm = opts.fuses_lm(sampled=True)

    def draws(self, teacher: ModelOut, seed: int, device):
        from kdexp.losses import sample_teacher

        s = self.sampled
        return sample_teacher(teacher.all_logits(), samples=s.samples,
                              proposal_temperature=s.proposal_temperature, temperature=self.opts.temperature,
                              seed=seed, normalize=s.normalize_weights, tp_group=distributed.tp_group())

    def prepare(self, teacher: ModelOut, seed: int, device):
        from kdexp.losses.sampled import unique_mass

        draw = self.draws(teacher, seed, device)
        mass, distinct = unique_mass(draw)
        return draw, TermStats(kept_mass=mass, nucleus_size=distinct.float())

    def chunk(self, z, side, rows: slice, labels) -> ChunkLoss:
        from kdexp.losses import sampled_kd_loss

        draw, stats = side
        out = sampled_kd_loss(z, draw.ids[rows], draw.weights[rows], draw.teacher_logprobs[rows],
                              temperature=self.opts.temperature,
                              scale_by_temperature_squared=self.opts.scale_by_temperature_squared,
                              tp_group=distributed.tp_group(), labels=labels)
        return ChunkLoss(*_split(out, labels), TermStats(*(None if v is None else v[rows] for v in stats)))


class CachedSampledTerm(SampledTerm):
    """Sampled KD on the draws stored in a cache's "sampled" record, weighed at the loss temperature."""

    def __init__(self, opts, sampled, cache):
        super().__init__(opts, sampled)
        self.cache = cache

    def draws(self, teacher: ModelOut, seed: int, device):
        from kdexp.losses import weigh

        draws = self.cache.read(teacher.sample_index, self.opts.temperature, device=device)
        draw = weigh(draws, temperature=self.opts.temperature,
                     proposal_temperature=self.cache.layout.proposal_temperature,
                     normalize=self.sampled.normalize_weights)
        return type(draw)(*(x.flatten(0, 1) for x in draw))


def _check_record(cache, want: str, sampled: SampledKDOptions):
    if cache.layout.record != want:  # the cache key follows the config: only a caller's mix-up
        raise ValueError(f"loss.samples={sampled.samples!r} cannot be served by the teacher cache {cache.path}: it "
                         f"holds {cache.layout.record!r} records")
    return cache


# (family, teacher kind) -> factory(loss_cfg, teacher source) -> KDTerm; options parsed here, once.
LOSSES: dict[tuple[str, str], Callable] = {
    ("logit", "online"): lambda c, t: LogitTerm(KDLossOptions.from_config(c)),
    ("logit", "cached"): lambda c, t: CachedLogitTerm(
        KDLossOptions.from_config(c), _check_record(t.cache, "topk", SampledKDOptions.from_config(c))),
    ("sampled", "online"): lambda c, t: SampledTerm(KDLossOptions.from_config(c), SampledKDOptions.from_config(c)),
    ("sampled", "cached"): lambda c, t: CachedSampledTerm(
        KDLossOptions.from_config(c), SampledKDOptions.from_config(c),
        _check_record(t.cache, "sampled", SampledKDOptions.from_config(c))),
}
# loss.name -> family: the shipped conf/loss options are all logit losses (sampled whenever loss.samples is set).
FAMILIES: dict[str, str] = {"dense": "logit", "topk": "logit", "top_p": "logit", "renorm_topk": "logit",
                            "sampled": "logit"}


def register_loss(name: str, factory: Callable, teachers=("online",)) -> None:
    """Register a loss: conf/loss/<name>.yaml sets `name: <name>`; `factory(loss_cfg, teacher_source)` returns its
    KDTerm (prepare / chunk, see LogitTerm). `teachers`: the teacher kinds it serves."""
    FAMILIES[name] = name
    for kind in teachers:
        LOSSES[(name, kind)] = factory


def family(loss_cfg) -> str:
    if SampledKDOptions.from_config(loss_cfg).enabled:
        return "sampled"
    if loss_cfg.name not in FAMILIES:
        raise ValueError(f"loss.name={loss_cfg.name!r} is invalid: must be a registered loss, one of "
                         f"{', '.join(sorted(FAMILIES))} (kdexp.train.objective.register_loss)")
    return FAMILIES[loss_cfg.name]


# ---------------------------------------------------------------------------------------------------- objective

def _cross_entropy(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Megatron's vocab-parallel next-token cross-entropy per token (it works in place: never on the caller's z)."""
    from megatron.core import tensor_parallel

    x = z.float()
    if x is z:
        x = z.clone()
    return tensor_parallel.vocab_parallel_cross_entropy(x, labels)


class Objective:
    """Built once by `build`; per micro-batch: `teacher(batch)`, `student(model, batch)`, then
    `__call__(student_out, teacher_out, batch, denom, seed, needs_lm)` -> ObjectiveResult."""

    def __init__(self, loss_cfg, teacher_source, term, *, fused: bool, fuses_lm: bool, coefficients=None,
                 eval_teacher=None, student_layers=(), pairs=()):
        self.loss_cfg, self.teacher, self.term = loss_cfg, teacher_source, term
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
        mean = objectives.masked_mean
        return (mean(c.kd, mask, denom), None if c.lm is None else mean(c.lm, mask, denom),
                None if c.stats is None else type(c.stats)(*(None if v is None else mean(v.detach(), mask, denom)
                                                             for v in c.stats)))

    def __call__(self, s: ModelOut, t: ModelOut, batch: dict, denom, *, seed: int = 0,
                 needs_lm: bool = True) -> ObjectiveResult:
        labels = batch["labels"].reshape(-1)
        mask = batch["loss_mask"].reshape(-1)
        side = self.term.prepare(t, seed, labels.device)
        fuse, term = self.fuses_lm, self.term

        def loss_fn(z, rows: slice) -> ChunkLoss:
            lab = labels[rows]
            c = term.chunk(z, side, rows, lab if fuse else None)
            if c.lm is not None:
                return c
            if needs_lm:
                return c._replace(lm=_cross_entropy(z, lab))
            with torch.no_grad():  # alpha == 1: logged only, out of the graph
                return c._replace(lm=_cross_entropy(z.detach(), lab))

        kd, lm, stats = self._apply(loss_fn, s, mask.float(), denom, self.coefficients)
        inter = None
        if self.pairs:
            inter = objectives.intermediate_loss(s.model, self.loss_cfg, s.layers, t.layers, batch["loss_mask"],
                                                 denom)
        if stats is not None and not isinstance(stats, TermStats):
            raise ValueError(f"{type(term).__name__}.chunk returned stats of type {type(stats).__name__}: must be None "
                             "or kdexp.train.objective.TermStats")
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
            same = (objectives.vocab_parallel_argmax(z) == objectives.vocab_parallel_argmax(tz)).float()
            return ChunkLoss(kl, _cross_entropy(z, labels[rows]), _EvalStats(same))

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
    rows_per = head_chunk_rows(n, out.weight.shape[0], out.weight.dtype)
    for lo in range(0, n, rows_per):
        rows = slice(lo, min(n, lo + rows_per))
        z = out.chunk_logits(rows)
        c = loss_fn(z, rows)
        w = token_weight[rows]
        kd, lm = kd + (c.kd.float() * w).sum(), lm + (c.lm.float() * w).sum()
        top1 = top1 + (c.stats.top1.float() * w).sum()
    return kd, lm, _EvalStats(top1)


def build(cfg, data, teacher_model, balancer, student=None) -> Objective:
    """The run's objective from cfg.loss and cfg.teacher: the teacher source (TEACHERS), the loss term (LOSSES),
    whether the head is fused (loss.fused_head: kdexp.losses.head.uses_fused_head), the balancer's fixed coefficients
    (the head's gradients in the forward pass) and the hidden-state pairs."""
    loss_cfg = cfg.loss
    spec = getattr(teacher_model, "kdexp_spec", None)  # the padded vocabulary the plan sizes (one tokenizer)
    vocab = spec.vocab_size if spec is not None else data.vocab_size
    fused = uses_fused_head(getattr(loss_cfg, "fused_head", False),
                            int(cfg.trainer.micro_batch_size) * int(cfg.trainer.seq_length),
                            -(-vocab // int(cfg.parallel.tensor)))
    s_layers, t_layers = objectives.intermediate_layers(loss_cfg)
    source = TEACHERS[cfg.teacher.name](cfg, data, teacher_model, fused=fused, layers=t_layers)
    fam = family(loss_cfg)
    key = (fam, cfg.teacher.name)
    if key not in LOSSES:
        raise ValueError(f"loss.name={loss_cfg.name!r} is invalid with teacher={cfg.teacher.name}: the loss serves "
                         f"teacher(s) {sorted(k for f, k in LOSSES if f == fam)}")
    term = LOSSES[key](loss_cfg, source)
    fuses_lm = bool(getattr(term, "fuses_lm", False))
    coefficients = getattr(balancer, "coefficients", None) if not s_layers else None
    eval_teacher = OnlineTeacher(teacher_model, fused=fused)
    return Objective(loss_cfg, source, term, fused=fused, fuses_lm=fuses_lm, coefficients=coefficients,
                     eval_teacher=eval_teacher, student_layers=s_layers, pairs=loss_cfg.intermediate or [])
