"""The options of the logit KD loss and of the balancers, defined once: names, defaults and value rules.

No torch here: the config schema (kdexp.config) subclasses these and is read before anything heavy is imported.

`KDLossOptions` holds exactly the keyword arguments of `logits_kd_loss` that describe the loss (not the runtime ones:
tp_group, return_stats, chunk_tokens), with the same names and defaults. Everything that needs the option set builds
on it instead of repeating it:
- `logits_kd_loss` builds one from its keywords and calls `check`, then `check_vocabulary` once the (global)
  vocabulary size is known;
- `kdexp.config.LossConfig` subclasses it (adding the group option's `name` and the run's defaults), so the Hydra
  schema has the same keys, and `config.validate` calls `check(vocab_size, prefix="loss.")` before anything is built;
- `KDLossOptions.from_config(node).kwargs()` gives the keywords for `logits_kd_loss` from a config node (attributes
  or a mapping; no Hydra import here): the one factory between config and loss.

Adding a loss option = a field here (name, default, rule in `check`) + its keyword in logits.py (and cached.py) and
its use in the chunk kernels (_chunks.make_cfg, _sparse); the schema inherits the field and the group YAML files
hold only what an option changes. Not frozen: OmegaConf makes a frozen
dataclass read-only, and the schema subclass must accept command-line overrides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Optional

from kdexp.rules import fail, is_int as _is_int, is_real as _is_real

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")  # kdexp.losses.divergence implements them
NORMALIZATIONS = ("full", "renormalize")
INTERMEDIATE_KINDS = ("cosine", "mse")  # kdexp.losses.intermediate implements them


def _yaml(x) -> str:
    """A value as the user types it on the command line (null, true/false, 'text', numbers)."""
    return "null" if x is None else str(x).lower() if isinstance(x, bool) else repr(x)


class LossName(NamedTuple):
    """What `loss=<name>` (conf/loss/<name>.yaml, `name: <name>`) stands for: the objective's term family
    (kdexp.objective.terms.LOSSES; loss.samples set always selects "sampled") and what the name promises of the
    options. A set of options that breaks the promise is refused by kdexp.config.validate rather than run under a
    name that no longer says what it trains (a registered loss promises nothing)."""

    family: str
    need: tuple[str, ...] = ()  # keys that must be set
    unset: tuple[str, ...] = ()  # keys that must be null (a top_p that cuts nothing counts as null)
    normalization: Optional[str] = None  # the normalization it needs; None: any


# The one table of loss names: the schema's default (kdexp.config.LossConfig.name) is one of them, validate() refuses
# any other name before anything is built, --help lists them, the objective maps each to its term family, and
# kdexp.objective.register_loss adds a new loss here. In the order a set of options is matched to the name whose
# promise it keeps (the most specific first).
LOSS_NAMES: dict[str, LossName] = {
    "sampled": LossName("logit", need=("samples",)),
    "top_p": LossName("logit", need=("top_p",), unset=("samples",)),
    "renorm_topk": LossName("logit", need=("top_k",), unset=("samples",), normalization="renormalize"),
    "topk": LossName("logit", need=("top_k",), unset=("samples",), normalization="full"),
    "dense": LossName("logit", unset=("top_k", "top_p", "samples"), normalization="full"),
}


def register_loss_name(name: str, family: str) -> None:
    """A new loss's name (kdexp.objective.register_loss calls this): accepted by validate(), promising nothing."""
    LOSS_NAMES[name] = LossName(family)


def cuts(top_p: Optional[float]) -> bool:
    """Whether a top_p cuts a nucleus: None or 1.0 keeps every candidate (the one rule; the kernels, the config
    checks and the plan ask it)."""
    return top_p is not None and float(top_p) != 1.0


@dataclass
class KDLossOptions:
    temperature: float = 1.0  # logits / T before both softmaxes; finite, > 0
    top_k: Optional[int] = None  # the teacher's global top-K candidates; None = the whole vocabulary
    top_p: Optional[float] = None  # nucleus cut over the sorted candidates, (0, 1]; None (or 1.0) = no cut
    min_k: int = 1  # entries always kept by the nucleus cut
    ghost_token: bool = True  # one bucket for the residual mass (normalization="full" only)
    normalization: str = "full"  # full: log-probs over the whole vocabulary; renormalize: over the kept set
    divergence: str = "forward_kl"  # one of DIVERGENCES
    beta: float = 0.5  # JSD: the teacher's weight in the mixture, (0, 1)
    scale_by_temperature_squared: bool = False  # multiply the loss by T^2 (Hinton et al.)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(KDLossOptions))

    @classmethod
    def from_config(cls, node: Any) -> "KDLossOptions":
        """The loss options of a config node (an object with these attributes, or a mapping); other keys, such as
        the group option's `name`, are ignored."""
        get = node.__getitem__ if isinstance(node, dict) else lambda k: getattr(node, k)
        return KDLossOptions(**{k: get(k) for k in KDLossOptions.names()})

    @property
    def dense(self) -> bool:
        """The whole vocabulary, no cut (top_p 1.0 cuts nothing): the dense loss."""
        return self.top_k is None and not cuts(self.top_p)

    def fuses_lm(self, sampled: bool = False) -> bool:
        """Whether this KD loss can compute the LM cross-entropy in its own pass over the student's vocabulary
        (`labels=`): a Top-K / Top-P loss, or sampled KD (`sampled`), at temperature 1. The dense loss, or another
        temperature (the LM loss is at T = 1), leave it to a separate cross-entropy."""
        return float(self.temperature) == 1.0 and (sampled or not self.dense)

    def kwargs(self) -> dict:
        """The keyword arguments of `logits_kd_loss` (only the loss options, also for a subclass instance)."""
        return {k: getattr(self, k) for k in KDLossOptions.names()}

    def _fail(self, key: str, allowed: str, prefix: str):
        fail(prefix + key, getattr(self, key), allowed)

    def check(self, vocab_size: Optional[int] = None, prefix: str = "") -> "KDLossOptions":
        """Raise ValueError naming the first bad option (with `prefix`, e.g. "loss."), its value and the allowed
        range. `vocab_size` (the global vocabulary) bounds top_k and min_k when it is known."""
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not t > 0:
            self._fail("temperature", "must be a finite number > 0", prefix)
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            self._fail("top_k", "must be an integer >= 1 (or null for the whole vocabulary)", prefix)
        p = self.top_p
        if p is not None and (not _is_real(p) or not 0.0 < p <= 1.0):
            self._fail("top_p", "must be in (0, 1] (or null for no nucleus cut)", prefix)
        if not _is_int(self.min_k) or self.min_k < 1:
            self._fail("min_k", "must be an integer >= 1", prefix)
        if self.top_k is not None and self.min_k > self.top_k:
            self._fail("min_k", f"must be in [1, {prefix}top_k={self.top_k}]", prefix)
        if not isinstance(self.ghost_token, bool):
            self._fail("ghost_token", "must be true or false", prefix)
        if self.normalization not in NORMALIZATIONS:
            self._fail("normalization", f"must be one of {', '.join(NORMALIZATIONS)}", prefix)
        if self.divergence not in DIVERGENCES:
            self._fail("divergence", f"must be one of {', '.join(DIVERGENCES)}", prefix)
        if self.normalization == "renormalize" and self.ghost_token:
            self._fail("ghost_token", f"must be false with {prefix}normalization='renormalize' (the re-normalised "
                                      "kept set has no residual mass), or use normalization='full'", prefix)
        if not _is_real(self.beta) or not 0.0 < self.beta < 1.0:
            self._fail("beta", "must be in (0, 1) (the teacher's weight in the JSD mixture; unused by the KLs)", prefix)
        if not isinstance(self.scale_by_temperature_squared, bool):
            self._fail("scale_by_temperature_squared", "must be true or false", prefix)
        if vocab_size is not None:
            self.check_vocabulary(vocab_size, prefix)
        return self

    def check_vocabulary(self, vocab_size: int, prefix: str = "") -> "KDLossOptions":
        """top_k and min_k within the (global) vocabulary: the one rule that needs the model."""
        for key in ("top_k", "min_k"):
            value = getattr(self, key)
            if value is not None and value > vocab_size:
                self._fail(key, f"must be in [1, the vocabulary size {vocab_size}]", prefix)
        return self


@dataclass
class SampledKDOptions:
    """Sampled KD (RS-KD, kdexp.losses.sampled): set `samples` to replace the logit loss by the importance-sampled
    estimator of the full forward-KL gradient. It uses loss.temperature (the target p) and
    loss.scale_by_temperature_squared of KDLossOptions; the Top-K/Top-P/ghost/normalization/divergence keys describe a
    different loss and must keep their dense forward-KL values."""

    samples: Optional[int] = None  # draws per token from the teacher's proposal (with replacement); None = not sampled
    proposal_temperature: float = 1.0  # the proposal q = softmax(teacher / this); unbiased when equal to temperature
    # true: weights c p / q normalised to sum 1 (the paper's); false: (c / samples) p / q, unbiased for any proposal
    normalize_weights: bool = True

    @classmethod
    def from_config(cls, node: Any) -> "SampledKDOptions":
        get = node.__getitem__ if isinstance(node, dict) else lambda k: getattr(node, k)
        return SampledKDOptions(**{f.name: get(f.name) for f in fields(SampledKDOptions)})

    @property
    def enabled(self) -> bool:
        return self.samples is not None

    def check(self, kd: KDLossOptions, prefix: str = "") -> "SampledKDOptions":
        """ValueError naming the key, the value and the allowed range; `kd` is the same node's logit-loss options."""
        t = self.proposal_temperature
        if not _is_real(t) or not math.isfinite(t) or not t > 0:
            raise ValueError(f"{prefix}proposal_temperature={t!r} is invalid: must be a finite number > 0")
        if not isinstance(self.normalize_weights, bool):
            raise ValueError(f"{prefix}normalize_weights={self.normalize_weights!r} is invalid: must be true or false")
        if self.samples is None:
            for key, default in (("proposal_temperature", 1.0), ("normalize_weights", True)):
                if getattr(self, key) != default:
                    raise ValueError(f"{prefix}{key}={getattr(self, key)!r} is invalid: it is used by sampled KD only; "
                                     f"set {prefix}samples (e.g. loss=sampled) or leave it at {_yaml(default)}")
            return self
        if not _is_int(self.samples) or self.samples < 1:
            raise ValueError(f"{prefix}samples={self.samples!r} is invalid: must be an integer >= 1 (draws per "
                             "token), or null for the logit losses")
        dense = {"top_k": None, "top_p": None, "ghost_token": False, "normalization": "full",
                 "divergence": "forward_kl"}
        for key, value in dense.items():
            if getattr(kd, key) != value:
                raise ValueError(f"{prefix}{key}={getattr(kd, key)!r} is invalid with {prefix}samples={self.samples}: "
                                 f"sampled KD estimates the full-vocabulary forward KL, set {prefix}{key}={_yaml(value)} "
                                 f"(loss=sampled does), or {prefix}samples=null for the logit loss")
        return self


@dataclass
class IntermediatePair:
    """One hidden-state loss between a student and a teacher decoder layer (0-based indices into decoder.layers, the
    layer's output before the final norm, as ModelOpt's `decoder.layers.N`). No defaults for the indices: OmegaConf
    reports a pair without them as a missing value."""

    student: int
    teacher: int
    kind: str = "cosine"  # one of INTERMEDIATE_KINDS


def check_intermediate(pairs: Any, student_layers: Optional[int], teacher_layers: Optional[int],
                       prefix: str = "") -> None:
    """ValueError naming the entry, key, value and range for each pair of `pairs` (a list of IntermediatePair-like
    nodes or mappings); the layer counts bound the indices when they are known."""
    if pairs is None:
        return
    for i, pair in enumerate(pairs):
        get = pair.__getitem__ if isinstance(pair, dict) else lambda k, p=pair: getattr(p, k)
        where = f"{prefix}intermediate[{i}]"
        for role, layers in (("student", student_layers), ("teacher", teacher_layers)):
            v = get(role)
            bound = f"[0, {layers - 1}] (the {role} has {layers} layers)" if layers else "an integer >= 0"
            if not _is_int(v) or v < 0 or (layers is not None and v >= layers):
                raise ValueError(f"{where}.{role}={v!r} is invalid: must be a layer index in {bound}")
        if get("kind") not in INTERMEDIATE_KINDS:
            raise ValueError(f"{where}.kind={get('kind')!r} is invalid: must be one of {', '.join(INTERMEDIATE_KINDS)}")


# The keys each balancer reads; the other keys of BalancerOptions must be unset (None) for it.
BALANCER_KEYS = {"alpha": ("alpha",), "dynamic": ("kd_loss_scale", "skip_lm_loss")}
BALANCERS = tuple(BALANCER_KEYS)
_REMOVED_KEYS = ("skip_lm_loss", "kd_loss_scale")  # ModelOpt's, removed from the alpha balancer


@dataclass
class BalancerOptions:
    """The balancer options, defined once: `kdexp.config.BalancerConfig` subclasses this (same keys, same defaults),
    `check` holds the value rules, `build` is the one factory. None means "not set": the dynamic balancer then takes
    its constructor defaults."""

    name: str = "alpha"  # one of BALANCERS
    alpha: Optional[float] = 0.9  # alpha: total = (1 - alpha) * lm + alpha * kd
    kd_loss_scale: Optional[float] = None  # dynamic (ModelOpt legacy): KD weight after rescaling to the LM loss
    skip_lm_loss: Optional[bool] = None  # dynamic: KD only

    @classmethod
    def from_config(cls, node: Any) -> "BalancerOptions":
        """The options of a config node (attributes or a mapping)."""
        get = node.__getitem__ if isinstance(node, dict) else lambda k: getattr(node, k)
        return BalancerOptions(**{f.name: get(f.name) for f in fields(BalancerOptions)})

    def kwargs(self) -> dict:
        """The constructor arguments of the chosen balancer: its keys that are set."""
        return {k: getattr(self, k) for k in BALANCER_KEYS[self.name] if getattr(self, k) is not None}

    def check(self, prefix: str = "") -> "BalancerOptions":
        """Raise ValueError naming the key, the value and the allowed range (keys prefixed, e.g. "balancer.")."""
        if self.name not in BALANCER_KEYS:
            raise ValueError(f"{prefix}name={self.name!r} is invalid: must be one of {', '.join(BALANCERS)}")
        for key in (f.name for f in fields(BalancerOptions)):
            value = getattr(self, key)
            if key == "name" or key in BALANCER_KEYS[self.name] or value is None:
                continue
            if self.name == "alpha" and key in _REMOVED_KEYS:
                raise ValueError(
                    f"{prefix}{key}={value!r} was removed from the alpha balancer (it is a key of ModelOpt's legacy "
                    f"dynamic balancer): use {prefix}alpha in [0, 1], total = (1 - alpha) * lm + alpha * kd; "
                    f"skip_lm_loss=True means {prefix}alpha=1.0 (or {prefix}name=dynamic for the legacy scaling)")
            raise ValueError(f"{prefix}{key}={value!r} is invalid: balancer {self.name!r} ignores it (its keys: "
                             f"{', '.join(BALANCER_KEYS[self.name])}); remove it (set it to null)")
        if self.name == "alpha":
            a = self.alpha
            if not _is_real(a) or not math.isfinite(a) or not 0.0 <= a <= 1.0:
                raise ValueError(f"{prefix}alpha={a!r} is invalid: must be a number in [0, 1]")
        else:
            s = self.kd_loss_scale
            if s is not None and (not _is_real(s) or not math.isfinite(s) or not s > 0):
                raise ValueError(f"{prefix}kd_loss_scale={s!r} is invalid: must be a finite number > 0")
            if self.skip_lm_loss is not None and not isinstance(self.skip_lm_loss, bool):
                raise ValueError(f"{prefix}skip_lm_loss={self.skip_lm_loss!r} is invalid: must be true or false")
        return self

    def build(self):
        """The balancer these options describe (checked first)."""
        from kdexp.losses.balancers import BALANCER_CLASSES  # imported here: this module stays free of torch

        return BALANCER_CLASSES[self.check().name](**self.kwargs())
