"""Typed schema of a kdexp run and the value checks that run before anything is built.

The dataclasses are registered in Hydra's ConfigStore as ``kdexp_schema``; ``conf/config.yaml`` puts that schema first
in its defaults list, so a wrong type or an unknown key fails when Hydra composes the config. ``validate(cfg)`` then
checks values and cross-key constraints (top_p in (0, 1], min_k <= top_k, TP size dividing heads and vocabulary, ...)
and raises ``ValueError`` naming the key, the value and the allowed range. It needs no model, data or process group.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


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
class LossConfig:
    name: str = "topk"
    temperature: float = 1.0
    top_k: Optional[int] = 1024
    top_p: Optional[float] = None
    min_k: int = 1
    ghost_token: bool = True
    normalization: str = "full"  # full | renormalize
    divergence: str = "forward_kl"  # forward_kl | reverse_kl | jsd
    jsd_beta: float = 0.5
    temperature_squared: bool = False  # multiply the KD loss by T^2 (Hinton); off by default


@dataclass
class BalancerConfig:
    name: str = "alpha"  # alpha | dynamic
    alpha: Optional[float] = 0.9
    # ModelOpt's legacy dynamic balancer; these keys are rejected with the alpha balancer.
    kd_loss_scale: Optional[float] = None
    skip_lm_loss: Optional[bool] = None


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
_DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
_NORMALIZATIONS = ("full", "renormalize")


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{key}={value!r} is invalid: {allowed}")


def _check_loss(loss: Any, vocab: Optional[int]) -> None:
    if not loss.temperature > 0:
        _fail("loss.temperature", loss.temperature, "must be > 0")
    if loss.top_p is not None and not 0.0 < loss.top_p <= 1.0:
        _fail("loss.top_p", loss.top_p, "must be in (0, 1] (or null for no nucleus)")
    if loss.top_k is not None:
        if loss.top_k < 1:
            _fail("loss.top_k", loss.top_k, "must be >= 1 (or null for the whole vocabulary)")
        if vocab is not None and loss.top_k > vocab:
            _fail("loss.top_k", loss.top_k, f"must be <= the vocabulary size {vocab}")
    if loss.min_k < 1:
        _fail("loss.min_k", loss.min_k, "must be >= 1")
    if loss.top_k is not None and loss.min_k > loss.top_k:
        _fail("loss.min_k", loss.min_k, f"must be <= loss.top_k={loss.top_k}")
    if loss.divergence not in _DIVERGENCES:
        _fail("loss.divergence", loss.divergence, f"must be one of {_DIVERGENCES}")
    if loss.normalization not in _NORMALIZATIONS:
        _fail("loss.normalization", loss.normalization, f"must be one of {_NORMALIZATIONS}")
    if loss.normalization == "renormalize" and loss.ghost_token:
        _fail("loss.ghost_token", loss.ghost_token,
              "must be false with loss.normalization=renormalize (a renormalised Top-K has no residual mass)")
    if loss.divergence == "jsd" and not 0.0 < loss.jsd_beta < 1.0:
        _fail("loss.jsd_beta", loss.jsd_beta, "must be in (0, 1)")


def _check_balancer(bal: Any) -> None:
    if bal.name == "alpha":
        if bal.skip_lm_loss is not None:
            raise ValueError(
                f"balancer.skip_lm_loss={bal.skip_lm_loss!r} was removed (ModelOpt's legacy key): use balancer.alpha "
                "instead; skip_lm_loss=True means balancer.alpha=1.0")
        if bal.kd_loss_scale is not None:
            raise ValueError(
                f"balancer.kd_loss_scale={bal.kd_loss_scale!r} was removed (ModelOpt's legacy key): use balancer.alpha "
                "to weight KD against LM as (1 - alpha) * lm + alpha * kd (or balancer=dynamic for the legacy behaviour)")
        if bal.alpha is None or not 0.0 <= bal.alpha <= 1.0:
            _fail("balancer.alpha", bal.alpha, "must be in [0, 1]")
    elif bal.name == "dynamic":
        if bal.kd_loss_scale is not None and not bal.kd_loss_scale > 0:
            _fail("balancer.kd_loss_scale", bal.kd_loss_scale, "must be > 0")
    else:
        _fail("balancer.name", bal.name, "must be 'alpha' or 'dynamic'")


def _model_shape(name: str, key: str):
    from kdexp.models.spec import QWEN3_SIZES

    if name not in QWEN3_SIZES:
        _fail(key, name, f"must be one of {sorted(QWEN3_SIZES)}")
    return QWEN3_SIZES[name]


def _check_model(cfg: Any) -> None:
    m = cfg.model
    _model_shape(m.teacher, "model.teacher")
    _model_shape(m.student, "model.student")
    if m.params_dtype not in _DTYPES:
        _fail("model.params_dtype", m.params_dtype, f"must be one of {_DTYPES}")
    for key in ("teacher_path", "student_path"):
        path = getattr(m, key)
        if path is not None and not (Path(path) / "config.json").is_file():
            _fail(f"model.{key}", path, "must be a local Hugging Face checkpoint directory with config.json")
    if m.teacher_path is None and not m.teacher.startswith("tiny"):
        _fail("model.teacher_path", None,
              f"is required for the real teacher model.teacher={m.teacher!r} (only tiny teachers are pretrained here)")
    if m.teacher_pretrain_steps < 1:
        _fail("model.teacher_pretrain_steps", m.teacher_pretrain_steps, "must be >= 1")


def _vocab_sizes(cfg: Any) -> tuple[Optional[int], Optional[int]]:
    """Teacher and student vocabulary as far as it is known without building anything."""
    def size(name: str, key: str, path: Optional[str]) -> Optional[int]:
        if path is not None:
            return json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        spec = _model_shape(name, key)
        if name.startswith("tiny"):  # tiny presets take the tokenizer's vocabulary
            return cfg.data.vocab_size if cfg.data.name == "stdlib" else None
        return spec.vocab_size

    return (size(cfg.model.teacher, "model.teacher", cfg.model.teacher_path),
            size(cfg.model.student, "model.student", cfg.model.student_path))


def _check_parallel(cfg: Any, vocab: Optional[int]) -> None:
    tp = cfg.parallel.tensor
    if tp < 1:
        _fail("parallel.tensor", tp, "must be >= 1")
    if cfg.parallel.pipeline != 1:
        _fail("parallel.pipeline", cfg.parallel.pipeline, "must be 1 (pipeline parallelism is not supported yet)")
    for role in ("teacher", "student"):
        path = getattr(cfg.model, f"{role}_path")
        if path is not None:
            hf = json.loads((Path(path) / "config.json").read_text())
            heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
        else:
            spec = _model_shape(getattr(cfg.model, role), f"model.{role}")
            heads, kv = spec.num_heads, spec.num_kv_heads
        for what, n in (("attention heads", heads), ("key/value heads", kv)):
            if n % tp:
                _fail("parallel.tensor", tp, f"must divide the {role}'s {n} {what}")
    if vocab is not None and vocab % tp:
        _fail("parallel.tensor", tp, f"must divide the vocabulary size {vocab}")


def _check_trainer(t: Any) -> None:
    for key in ("max_steps", "micro_batch_size", "seq_length", "eval_interval", "eval_iters", "log_interval",
                "checkpoint_interval"):
        if getattr(t, key) < 1:
            _fail(f"trainer.{key}", getattr(t, key), "must be >= 1")
    if t.warmup_steps < 0:
        _fail("trainer.warmup_steps", t.warmup_steps, "must be >= 0")
    if not t.lr > 0 or t.min_lr < 0 or t.min_lr > t.lr:
        _fail("trainer.min_lr", t.min_lr, f"must be in [0, trainer.lr={t.lr}] with trainer.lr > 0")
    if t.grad_clip < 0:
        _fail("trainer.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")


def validate(cfg: Any) -> None:
    """Check every value before any model, data or process group is built."""
    if cfg.data.name not in ("stdlib", "indexed"):
        _fail("data.name", cfg.data.name, "must be 'stdlib' or 'indexed'")
    if cfg.data.name == "indexed" and not cfg.data.prefixes:
        _fail("data.prefixes", list(cfg.data.prefixes), "must list at least one Megatron .bin/.idx prefix")
    if cfg.data.name == "stdlib" and not 256 < cfg.data.vocab_size <= 1_000_000:
        _fail("data.vocab_size", cfg.data.vocab_size, "must be in (256, 1000000]")
    if not 0.0 < cfg.data.val_fraction < 0.5:
        _fail("data.val_fraction", cfg.data.val_fraction, "must be in (0, 0.5)")
    _check_model(cfg)
    teacher_vocab, student_vocab = _vocab_sizes(cfg)
    if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
        raise ValueError(f"model.teacher vocabulary ({teacher_vocab}) and model.student vocabulary ({student_vocab}) "
                         "differ: logit distillation needs one shared vocabulary")
    _check_loss(cfg.loss, teacher_vocab)
    _check_balancer(cfg.balancer)
    _check_trainer(cfg.trainer)
    _check_parallel(cfg, teacher_vocab)


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
