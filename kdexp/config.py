"""Typed schema of a kdexp run and the value checks that run before anything is built.

The dataclasses are registered in Hydra's ConfigStore as ``kdexp_schema``; ``conf/config.yaml`` puts that schema first
in its defaults list, so a wrong type or an unknown key fails when Hydra composes the config. ``validate(cfg)`` then
checks values and cross-key constraints (top_p in (0, 1], min_k <= top_k, TP size dividing heads and vocabulary, ...)
and raises ``ValueError`` naming the key, the value and the allowed range. It needs no model, data or process group.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kdexp.losses.options import BalancerOptions, KDLossOptions


@dataclass
class ModelConfig:
    teacher: str = "tiny-teacher"  # a name in kdexp.models.QWEN3_SIZES
    student: str = "tiny-student"
    teacher_path: Optional[str] = None  # local HF checkpoint dir; required for real (non-tiny) teachers
    student_path: Optional[str] = None  # local HF checkpoint dir to start the student from; None = random init
    params_dtype: str = "float32"  # float32 | bfloat16
    # Embedded default only: the tiny teacher is pretrained on the corpus once, then cached.
    teacher_pretrain_steps: int = 300
    teacher_pretrain_lr: float = 3e-3


@dataclass
class LossConfig(KDLossOptions):
    """The loss group: the keywords of kdexp.losses.logits_kd_loss (their value rules live there), plus the option's
    name. The run's default is Top-K 1024 with a ghost token (logits_kd_loss's own default is dense)."""

    name: str = "topk"
    top_k: Optional[int] = 1024


@dataclass
class BalancerConfig(BalancerOptions):
    """The balancer group: kdexp.losses.BalancerOptions (alpha | dynamic; keys the chosen one ignores are rejected)."""


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | indexed
    vocab_size: int = 4096  # stdlib: size of the BPE trained on the corpus
    max_chars: int = 4_000_000  # stdlib: cap on the embedded corpus
    val_fraction: float = 0.03
    prefixes: List[str] = field(default_factory=list)  # indexed: Megatron .bin/.idx prefixes (optionally weighted)
    tokenizer: Optional[str] = None  # indexed: dir with tokenizer.json (default: model.teacher_path)
    split: str = "969,30,1"  # indexed: train,valid,test split of each prefix
    valid_prefixes: List[str] = field(default_factory=list)  # indexed: separate validation data (then no split)
    max_documents: Optional[int] = None  # stdlib: cap on the number of documents


@dataclass
class TrainerConfig:
    max_steps: int = 200
    micro_batch_size: int = 4
    seq_length: int = 256
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_interval: int = 50
    eval_iters: int = 8
    log_interval: int = 10
    checkpoint_interval: int = 50
    seed: int = 1234
    skip_nonfinite: int = 0  # non-finite steps to skip (no update) before the run stops as diverged
    reuse_finished: bool = True  # in a sweep, a point whose resolved config already finished is not retrained
    export_hf: bool = False  # at the end, write the distilled student as a Hugging Face checkpoint (run_dir/student_hf)


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: Optional[str] = None  # None: $WANDB_MODE, else "offline"; "online" | "offline" | "disabled"
    project: str = "kdexp"
    entity: Optional[str] = None
    group: Optional[str] = None  # None: the sweep's directory name in a sweep, else no group
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    name: str = "default"
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class PathsConfig:
    cache: str = MISSING  # tokenizer, datasets, the pretrained embedded teacher
    index: str = MISSING  # finished points keyed by their resolved config (sweep re-runs skip them)


@dataclass
class KdexpConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    experiment_arm: Optional[str] = None  # set by arm/* presets (experiment=qwen3_before_after)


def register() -> None:
    ConfigStore.instance().store(name="kdexp_schema", node=KdexpConfig)


register()


# ----------------------------------------------------------------------------------------------------------------------
# value checks

_DTYPES = ("float32", "bfloat16")
def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{key}={value!r} is invalid: {allowed}")


# Generic rules: the one-line message says what the value must be.


def _number(key: str, value: Any, *, gt: Optional[float] = None, ge: Optional[float] = None,
            lt: Optional[float] = None, le: Optional[float] = None) -> None:
    """A finite real number (not a bool) within the given bounds."""
    lo, hi = (gt, "(") if gt is not None else (ge, "["), (lt, ")") if lt is not None else (le, "]")
    if lo[0] is not None and hi[0] is not None:
        allowed = f"must be a finite number in {lo[1]}{lo[0]:g}, {hi[0]:g}{hi[1]}"
    else:
        bounds = [f"{op} {b:g}" for op, b in ((">", gt), (">=", ge), ("<", lt), ("<=", le)) if b is not None]
        allowed = "must be a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(key, value, allowed)
    if (gt is not None and not value > gt) or (ge is not None and not value >= ge) or \
            (lt is not None and not value < lt) or (le is not None and not value <= le):
        _fail(key, value, allowed)


def _integer(key: str, value: Any, *, ge: Optional[int] = None, lt: Optional[int] = None,
             none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if ge is not None and lt is not None:
        allowed = f"must be an integer in [{ge}, {lt - 1}]"
    else:
        allowed = "must be an integer" + (f" >= {ge}" if ge is not None else "") + (f" < {lt}" if lt is not None else "")
    allowed += " (or null)" if none_ok else ""
    if isinstance(value, bool) or not isinstance(value, int) or (ge is not None and value < ge) or \
            (lt is not None and value >= lt):
        _fail(key, value, allowed)


def _text(key: str, value: Any, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, str) or not value.strip():
        _fail(key, value, "must be a non-empty string" + (" (or null)" if none_ok else ""))


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(key, value, "must be one of " + ", ".join("null" if c is None else str(c) for c in choices))


def _unresolved(cfg: Any) -> None:
    """A required value left unset (``???``) or an interpolation that does not resolve, named by its key."""
    if not OmegaConf.is_config(cfg):
        return
    try:
        missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
        if missing:
            _fail(missing[0], "???", "must be set (this option requires it)")
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        raise ValueError(f"{key}={raw!r} is invalid: {type(err).__name__}: {str(err).splitlines()[0]}") from None


# ----------------------------------------------------------------------------------------------------------------------
# model: names, checkpoint dirs and what their config.json says


def _model_shape(name: str, key: str):
    from kdexp.models.spec import QWEN3_SIZES

    if name not in QWEN3_SIZES:
        _fail(key, name, f"must be one of {sorted(QWEN3_SIZES)}")
    return QWEN3_SIZES[name]


_HF_NEEDS = ("vocab_size", "num_attention_heads")  # what validate reads from a checkpoint's config.json


def _hf_config(key: str, path: str) -> dict:
    """The checkpoint's config.json, with the fields validate needs checked (a message naming ``key`` otherwise)."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        _fail(key, path, "must be a local Hugging Face checkpoint directory with config.json")
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        _fail(key, path, f"its config.json is not readable JSON ({type(err).__name__}: {err})")
    if not isinstance(hf, dict):
        _fail(key, path, "its config.json must hold a JSON object")
    for field_ in _HF_NEEDS + ("num_key_value_heads", "max_position_embeddings"):
        value = hf.get(field_)
        if value is None and field_ not in _HF_NEEDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(key, path, f"its config.json has no {field_!r}" if value is None else
                  f"its config.json has {field_}={value!r} (must be a positive integer)")
    return hf


def _shapes(cfg: Any) -> dict:
    """Per role: (vocabulary or None when the tokenizer decides it, heads, kv heads, max positions)."""
    out = {}
    for role in ("teacher", "student"):
        name, path = getattr(cfg.model, role), getattr(cfg.model, f"{role}_path")
        spec = _model_shape(name, f"model.{role}")
        if path is not None:
            hf = _hf_config(f"model.{role}_path", path)
            heads = hf["num_attention_heads"]
            out[role] = (hf["vocab_size"], heads, hf.get("num_key_value_heads") or heads,
                         hf.get("max_position_embeddings") or spec.max_position_embeddings)
            continue
        if name.startswith("tiny"):  # tiny presets take the tokenizer's vocabulary
            vocab = cfg.data.vocab_size if cfg.data.name == "stdlib" and cfg.data.tokenizer is None else None
        else:
            vocab = spec.vocab_size
        out[role] = (vocab, spec.num_heads, spec.num_kv_heads, spec.max_position_embeddings)
    return out


def _check_model(cfg: Any) -> None:
    m = cfg.model
    _model_shape(m.teacher, "model.teacher")
    _model_shape(m.student, "model.student")
    _choice("model.params_dtype", m.params_dtype, _DTYPES)
    if m.teacher_path is None and not str(m.teacher).startswith("tiny"):
        _fail("model.teacher_path", None,
              f"is required for the real teacher model.teacher={m.teacher!r} (only tiny teachers are pretrained here)")
    _integer("model.teacher_pretrain_steps", m.teacher_pretrain_steps, ge=1)
    _number("model.teacher_pretrain_lr", m.teacher_pretrain_lr, gt=0)


# ----------------------------------------------------------------------------------------------------------------------
# data


def _check_prefixes(key: str, items: Any) -> None:
    """Megatron prefixes [p, ...] or a weighted blend [w, p, w, p, ...]: each with its .bin and .idx."""
    items = [str(x) for x in items]
    weights = items[0::2] if len(items) % 2 == 0 else []

    def number(text: str) -> Optional[float]:
        try:
            return float(text)
        except ValueError:
            return None

    parsed = [number(w) for w in weights]
    if parsed and all(w is not None for w in parsed):
        for w in parsed:
            if not (math.isfinite(w) and w > 0):
                _fail(key, items, f"blend weight {w:g} must be a finite number > 0")
        prefixes = items[1::2]
    elif any(w is not None for w in parsed):
        _fail(key, items, "must be prefixes [p, ...] or a weighted blend [w, p, w, p, ...], not a mix")
    else:
        prefixes = items
    for p in prefixes:
        base = Path(p).expanduser()
        lacking = [ext for ext in (".bin", ".idx") if not Path(f"{base}{ext}").is_file()]
        if lacking:
            _fail(key, items, f"no indexed dataset at {p!r} (missing {' and '.join(f'{p}{e}' for e in lacking)})")


_SPLIT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*,\s*([0-9]+(?:\.[0-9]*)?)\s*,\s*([0-9]+(?:\.[0-9]*)?)\s*")


def _check_data(cfg: Any) -> None:
    d = cfg.data
    _choice("data.name", d.name, ("stdlib", "indexed"))
    _integer("data.vocab_size", d.vocab_size, ge=257, lt=1_000_001)
    _integer("data.max_chars", d.max_chars, ge=1)
    _integer("data.max_documents", d.max_documents, ge=1, none_ok=True)
    _number("data.val_fraction", d.val_fraction, gt=0, lt=0.5)
    m = _SPLIT.fullmatch(str(d.split))
    parts = [float(x) for x in m.groups()] if m else None
    if parts is None or not sum(parts) > 0:
        _fail("data.split", d.split, "must be 'train,valid,test': three non-negative numbers with a positive sum")
    if d.name == "stdlib":
        for key in ("prefixes", "valid_prefixes"):
            if list(getattr(d, key)):
                _fail(f"data.{key}", list(getattr(d, key)), "data=stdlib ignores it (only data=indexed reads it)")
    else:
        if not d.prefixes:
            _fail("data.prefixes", list(d.prefixes), "must list at least one Megatron .bin/.idx prefix")
        _check_prefixes("data.prefixes", d.prefixes)
        if d.valid_prefixes:
            _check_prefixes("data.valid_prefixes", d.valid_prefixes)
        elif not (parts[0] > 0 and parts[1] > 0):
            _fail("data.split", d.split, "must give train > 0 and valid > 0 (or set data.valid_prefixes)")
        if d.max_documents is not None:
            _fail("data.max_documents", d.max_documents, "data=indexed ignores it (only data=stdlib reads it)")


def _check_tokenizer(cfg: Any) -> None:
    """The tokenizer: data.tokenizer, else the teacher checkpoint's (with data=stdlib it replaces the trained BPE)."""
    d = cfg.data
    key, tok = ("data.tokenizer", d.tokenizer) if d.tokenizer is not None else \
        ("model.teacher_path", cfg.model.teacher_path)
    if tok is None:
        if d.name == "indexed":
            _fail("data.tokenizer", None, "must be a directory with tokenizer.json for data=indexed "
                  "(or set model.teacher_path to a checkpoint that holds one)")
        return
    tok = Path(tok).expanduser()
    if not ((tok / "tokenizer.json").is_file() or (tok / "tokenizer_config.json").is_file()):
        _fail(key, str(tok), "must be a directory with tokenizer.json (the tokenizer of the data)")


# ----------------------------------------------------------------------------------------------------------------------
# trainer, parallel, logger, paths


def _check_trainer(t: Any, max_positions: int) -> None:
    for key in ("max_steps", "micro_batch_size", "seq_length", "eval_interval", "eval_iters", "log_interval",
                "checkpoint_interval"):
        _integer(f"trainer.{key}", getattr(t, key), ge=1)
    if t.seq_length > max_positions:
        _fail("trainer.seq_length", t.seq_length, f"must be <= the models' max_position_embeddings {max_positions}")
    _integer("trainer.warmup_steps", t.warmup_steps, ge=0)
    if t.warmup_steps > t.max_steps:
        _fail("trainer.warmup_steps", t.warmup_steps, f"must be in [0, trainer.max_steps={t.max_steps}]")
    _number("trainer.lr", t.lr, gt=0)
    _number("trainer.min_lr", t.min_lr, ge=0)
    if t.min_lr > t.lr:
        _fail("trainer.min_lr", t.min_lr, f"must be in [0, trainer.lr={t.lr}]")
    _number("trainer.weight_decay", t.weight_decay, ge=0)
    _number("trainer.grad_clip", t.grad_clip, ge=0)  # 0 disables clipping
    _integer("trainer.seed", t.seed, ge=0, lt=2**32)
    _integer("trainer.skip_nonfinite", t.skip_nonfinite, ge=0)
    for key in ("reuse_finished", "export_hf"):
        if not isinstance(getattr(t, key), bool):
            _fail(f"trainer.{key}", getattr(t, key), "must be true or false")


def _check_parallel(cfg: Any, shapes: dict, vocab: Optional[int]) -> None:
    tp = cfg.parallel.tensor
    _integer("parallel.tensor", tp, ge=1)
    if cfg.parallel.pipeline != 1:
        _fail("parallel.pipeline", cfg.parallel.pipeline, "must be 1 (pipeline parallelism is not supported yet)")
    for role, (_, heads, kv, _) in shapes.items():
        for what, n in (("attention heads", heads), ("key/value heads", kv)):
            if n % tp:
                _fail("parallel.tensor", tp, f"must divide the {role}'s {n} {what}")
    if vocab is not None and vocab % tp:
        _fail("parallel.tensor", tp, f"must divide the vocabulary size {vocab}")
    world = os.environ.get("WORLD_SIZE")  # torchrun's; under SLURM the process group checks it
    if world and world.isdigit() and int(world) % tp:
        _fail("parallel.tensor", tp, f"must divide the world size {world} (WORLD_SIZE)")


_WANDB_MODES = ("online", "offline", "disabled", None)


def _check_logger(cfg: Any) -> None:
    lg, w = cfg.logger, cfg.logger.wandb
    _text("logger.name", lg.name)
    if not isinstance(w.enabled, bool):
        _fail("logger.wandb.enabled", w.enabled, "must be true or false")
    _choice("logger.wandb.mode", w.mode, _WANDB_MODES)
    _text("logger.wandb.project", w.project)
    _text("logger.wandb.entity", w.entity, none_ok=True)
    _text("logger.wandb.group", w.group, none_ok=True)
    for tag in w.tags:
        if not isinstance(tag, str) or not 0 < len(tag) <= 64:
            _fail("logger.wandb.tags", list(w.tags), f"each tag must be a string of 1 to 64 characters, not {tag!r}")
    if not w.enabled:
        for key in ("mode", "entity", "group"):
            if getattr(w, key) is not None:
                _fail(f"logger.wandb.{key}", getattr(w, key), "W&B is off (logger=none), so it would be ignored: drop it")


def _check_paths(cfg: Any) -> None:
    for key in ("cache", "index"):
        value = getattr(cfg.paths, key)
        _text(f"paths.{key}", value)
        p = Path(value).expanduser()
        if p.exists() and not p.is_dir():
            _fail(f"paths.{key}", value, "must be a directory (or not exist yet), not a file")
    _text("experiment_arm", cfg.experiment_arm, none_ok=True)


def validate(cfg: Any) -> None:
    """Check every value before W&B, data, teacher, model or any process group is built; a ``ValueError`` whose one
    line names the key, the value and what it must be."""
    _unresolved(cfg)
    _check_data(cfg)
    _check_model(cfg)
    shapes = _shapes(cfg)
    teacher_vocab, student_vocab = shapes["teacher"][0], shapes["student"][0]
    if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
        raise ValueError(f"model.teacher vocabulary ({teacher_vocab}) and model.student vocabulary ({student_vocab}) "
                         "differ: logit distillation needs one shared vocabulary")
    _check_tokenizer(cfg)
    KDLossOptions.from_config(cfg.loss).check(teacher_vocab, prefix="loss.")  # the loss's own rules
    BalancerOptions.from_config(cfg.balancer).check(prefix="balancer.")
    _check_trainer(cfg.trainer, min(s[3] for s in shapes.values()))
    _check_parallel(cfg, shapes, teacher_vocab)
    _check_logger(cfg)
    _check_paths(cfg)


# ----------------------------------------------------------------------------------------------------------------------
# identity of a run

# Keys that do not change what a run computes: where files go and how it is watched.
_IDENTITY_EXCLUDE = ("logger", "paths")


def config_hash(cfg: DictConfig) -> str:
    """A short hash of the resolved config minus logging and paths: the identity of a sweep point."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in _IDENTITY_EXCLUDE:
        data.pop(key, None)
    data.pop("hydra", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
