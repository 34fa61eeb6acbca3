"""The KD terms: one per loss family x teacher kind, the interface they meet (``KDTerm``) and the registry that maps
a run's config to one.

- ``LossOptions``: the loss config parsed and checked once per run (``kdexp.objective.build``), handed to the term
  factory and the teacher source; the terms keep what they need of it.
- ``LOSSES``: (family, teacher kind) -> a factory called once per run with (LossOptions, teacher source), returning a
  KDTerm.
- loss.name -> family: the one table of loss names, kdexp.losses.options.LOSS_NAMES ("logit" for the shipped logit
  losses; "sampled" whenever loss.samples is set); a new loss registers its own name with ``register_loss``
  (docs/extending.md).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from kdexp import distributed
from kdexp.losses import KDLossOptions, SampledKDOptions, cached_kd_loss, logits_kd_loss, sample_teacher, \
    sampled_kd_loss, weigh
from kdexp.losses.head import ChunkLoss
from kdexp.losses.options import LOSS_NAMES, register_loss_name
from kdexp.losses.sampled import unique_mass
from kdexp.objective.sources import ModelOut


class LossOptions(NamedTuple):
    """The run's loss config parsed once (kdexp.objective.build): ``cfg`` the loss node (a registered loss reads its
    own keys there), ``kd`` and ``sampled`` its logit-loss and sampled-KD options, checked (a direct caller of build
    that skipped kdexp.config.validate gets the same one-line errors)."""

    cfg: Any
    kd: KDLossOptions
    sampled: SampledKDOptions

    @classmethod
    def parse(cls, loss_cfg) -> "LossOptions":
        kd = KDLossOptions.from_config(loss_cfg).check(prefix="loss.")
        return cls(loss_cfg, kd, SampledKDOptions.from_config(loss_cfg).check(kd, prefix="loss."))


class TermStats(NamedTuple):
    """Per-token statistics of the KD term on a chunk ([c] each; None: not reported), logged as train/<field> (their
    token-weighted means): the teacher's mass the term keeps (the cut's, or the sampled draws' distinct ids), the
    student's mass on the ghost token (outside the kept ids), and how many ids the term keeps."""

    kept_mass: Optional[torch.Tensor] = None
    ghost_mass: Optional[torch.Tensor] = None
    nucleus_size: Optional[torch.Tensor] = None

    def logged(self, prefix: str) -> dict:
        return {f"{prefix}{k}": v.detach() for k, v in self._asdict().items() if v is not None}


class KDTerm(Protocol):
    """What the objective calls, per micro-batch: ``prepare`` once, then ``chunk`` on every chunk of the student's
    logits (the fused head's chunks, or all tokens at once on the reference path).

    - ``fuses_lm``: True when ``chunk`` returns the LM cross-entropy from its own pass over the vocabulary (it is
      then handed the chunk's labels); False and the objective adds the cross-entropy itself.
    - ``prepare(teacher, seed, device)``: the teacher's side of the whole micro-batch (the online teacher's ModelOut,
      a cache record, sampled draws made with ``seed``), handed back to every ``chunk`` call as ``side``.
    - ``chunk(z, side, rows, labels)``: the per-token loss of the student logits ``z`` [c, V/tp] (this rank's
      vocabulary shard) of token ``rows``: ``ChunkLoss(kd [c], lm [c] or None, TermStats or None)``, each value
      reduced over the TP group where it needs the whole vocabulary (equal on every TP rank).
    """

    fuses_lm: bool

    def prepare(self, teacher: ModelOut, seed: int, device) -> Any: ...

    def chunk(self, z: torch.Tensor, side: Any, rows: slice, labels: Optional[torch.Tensor]) -> ChunkLoss: ...


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
        out, stats = cached_kd_loss(z, *(x[rows] for x in side), tp_group=distributed.tp_group(),
                                    return_stats=True, labels=labels, **self.kw)
        return ChunkLoss(*_split(out, labels), _logit_stats(stats))


class SampledTerm:
    """Sampled KD (kdexp.losses.sampled) on draws from the online teacher's logits, seeded per micro-batch."""

    def __init__(self, opts: KDLossOptions, sampled: SampledKDOptions):
        self.opts, self.sampled = opts, sampled
        self.fuses_lm = opts.fuses_lm(sampled=True)

    def draws(self, teacher: ModelOut, seed: int, device):
        s = self.sampled
        return sample_teacher(teacher.all_logits(), samples=s.samples,
                              proposal_temperature=s.proposal_temperature, temperature=self.opts.temperature,
                              seed=seed, normalize=s.normalize_weights, tp_group=distributed.tp_group())

    def prepare(self, teacher: ModelOut, seed: int, device):
        draw = self.draws(teacher, seed, device)
        mass, distinct = unique_mass(draw)
        return draw, TermStats(kept_mass=mass, nucleus_size=distinct.float())

    def chunk(self, z, side, rows: slice, labels) -> ChunkLoss:
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


LOSSES: dict[tuple[str, str], Callable] = {
    ("logit", "online"): lambda o, t: LogitTerm(o.kd),
    ("logit", "cached"): lambda o, t: CachedLogitTerm(o.kd, _check_record(t.cache, "topk", o.sampled)),
    ("sampled", "online"): lambda o, t: SampledTerm(o.kd, o.sampled),
    ("sampled", "cached"): lambda o, t: CachedSampledTerm(o.kd, o.sampled,
                                                          _check_record(t.cache, "sampled", o.sampled)),
}


def register_loss(name: str, factory: Callable, teachers=("online",)) -> None:
    """Register a loss: conf/loss/<name>.yaml sets `name: <name>`; `factory(loss, teacher_source)` returns its
    KDTerm (`loss`: the run's LossOptions, `loss.cfg` its config node). `teachers`: the teacher kinds it serves
    ("online", "cached"). The name joins the one table of loss names (kdexp.losses.options.LOSS_NAMES), so that the
    config checks accept it."""
    register_loss_name(name, family=name)
    for kind in teachers:
        LOSSES[(name, kind)] = factory


def family(loss: LossOptions) -> str:
    if loss.sampled.enabled:
        return "sampled"
    name = loss.cfg.name
    if name not in LOSS_NAMES:
        raise ValueError(f"loss.name={name!r} is invalid: must be a registered loss, one of "
                         f"{', '.join(LOSS_NAMES)} (kdexp.objective.register_loss)")
    return LOSS_NAMES[name].family


def term(loss: LossOptions, source) -> KDTerm:
    """The run's KD term for its parsed loss options and teacher source (a ValueError naming the kinds a loss
    serves)."""
    fam = family(loss)
    key = (fam, source.kind)
    if key not in LOSSES:
        raise ValueError(f"loss.name={loss.cfg.name!r} is invalid with teacher={source.kind}: the loss serves "
                         f"teacher(s) {sorted(k for f, k in LOSSES if f == fam)}")
    return LOSSES[key](loss, source)
