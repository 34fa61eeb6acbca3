"""Where the objective's tokens and the teacher's side of them come from.

- ``ModelOut``: one model's output as the objective reads it: whole vocab-parallel logits (the reference path) or
  the final hidden states and output weight (the fused head forms the logits chunk by chunk), plus the decoder
  outputs the hidden-state losses read and, for a cached teacher, the cache keys.
- ``forward``: a model's forward into a ModelOut.
- ``TEACHERS``: teacher.name -> the teacher source: "online" (the frozen teacher model runs on the batch) or
  "cached" (an offline teacher cache, kdexp.teacher, built or verified when the source is made; with
  teacher.store=hidden its hidden states + the teacher's output layer, read by the online terms), each made once per
  run: a factory is called ``(cfg, data, teacher_model, fused=, layers=, opts=, identify=)`` with the run's parsed
  loss options; ``identify()`` returns what names the teacher's weights (the cache's key), asked only by a source
  that needs it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Optional

import torch
from megatron.core import tensor_parallel

from kdexp import distributed, models
from kdexp.losses import KDLossOptions, LogitRows
from kdexp.losses.head import teacher_head_logits, tp_copy
from kdexp.teacher.reader import check_nucleus
from kdexp.teacher.writer import ensure

log = logging.getLogger("kdexp")


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
    non-contiguous gradient (what the [s, b, h] -> [b*s, h] transpose hands back) would keep this rank's partial sum
    only, and every student gradient at TP > 1 would be wrong."""
    tp = distributed.state().tp_size > 1
    sp = tp and models.sequence_parallel(model)
    if sp:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
    return tp_copy(flat, distributed.tp_group()) if tp and not sp else flat


class OnlineTeacher:
    """The frozen teacher model runs on every batch (no grad); its hidden states feed the hidden-state losses."""

    kind = "online"
    hidden_states = True

    def __init__(self, model, *, fused: bool, layers=()):
        self.model, self.fused, self.layers = model, fused, list(layers)

    @torch.no_grad()
    def __call__(self, batch: dict) -> ModelOut:
        return forward(self.model, batch["tokens"], fused=self.fused, layers=self.layers)


class CachedTeacher:
    """The teacher's records of the batch's samples, read from an offline cache (kdexp.teacher.TeacherCache)."""

    kind = "cached"
    hidden_states = False

    def __init__(self, cache):
        self.cache = cache

    def __call__(self, batch: dict) -> ModelOut:
        return ModelOut(sample_index=batch["sample_index"])


class HiddenCacheTeacher:
    """teacher.store=hidden: the teacher's final hidden states of the batch's samples, read from an offline cache, and
    the teacher's own output layer (loaded once, TP-sharded, frozen): the ModelOut the online teacher's forward gives
    (hidden + weight on the fused head, where the logits are formed chunk by chunk; whole vocab-parallel logits on the
    reference path), so the online terms serve it: every loss family, K, nucleus and temperature, sampled KD's draws
    made at training time."""

    kind = "online"  # its ModelOut is the online teacher's: the online terms read it
    hidden_states = False  # the final ones only: no intermediate layers

    def __init__(self, cache, model, *, fused: bool):
        self.cache, self.fused = cache, fused
        self.weight = models.output_weight(model).detach()
        self.vocab_mask = models.padded_vocab_mask(model, self.weight.shape[0], self.weight.device)

    @torch.no_grad()
    def __call__(self, batch: dict) -> ModelOut:
        h = self.cache.read(batch["sample_index"], None, device=self.weight.device).to(self.weight.dtype)
        flat = h.reshape(-1, h.shape[-1])  # [b*s, H], tokens in the labels' order
        out = ModelOut(hidden=flat, weight=self.weight, vocab_mask=self.vocab_mask, sample_index=batch["sample_index"])
        if self.fused:
            return out
        z = out.masked(teacher_head_logits(flat, self.weight, slice(0, flat.shape[0])))
        return ModelOut(logits=z.reshape(*h.shape[:2], -1), sample_index=batch["sample_index"])


def _online(cfg, data, model, *, fused: bool, layers=(), opts: KDLossOptions,
            identify: Optional[Callable[[], dict]] = None):
    return OnlineTeacher(model, fused=fused, layers=layers)


def _cached(cfg, data, model, *, fused: bool, layers=(), opts: KDLossOptions,
            identify: Optional[Callable[[], dict]] = None):
    """`opts`: the run's loss options, parsed once (kdexp.objective.build); `identify`: the teacher's identity."""
    if identify is None:
        raise ValueError("teacher.name=cached: the cache is keyed by the teacher's identity, and none was handed in "
                         "(kdexp.objective.build's identify_teacher)")
    cache = ensure(cfg, data, model, identify())  # one teacher pass into the cache (skipped when it exists)
    if cache.layout.record == "hidden":
        return HiddenCacheTeacher(cache, model, fused=fused)
    if cache.layout.record == "topk" and opts.top_k is None and not opts.dense:  # a nucleus served from top-K_max
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
