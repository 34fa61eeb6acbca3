"""``validate(cfg)``: every value checked before W&B, data, teacher, model or any process group is built.

The per-key rules of the loss and balancer groups are the option classes' own (kdexp.losses.options); here stay the
cross-key checks that need the model or the TP size (top_k/min_k within the teacher's vocabulary, TP dividing heads
and vocabulary). A failure is a ``ValueError`` whose one line names the key, the value and the allowed range.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from kdexp.config.rules import unresolved
from kdexp.distributed import launch
from kdexp.rules import choice, fail, integer, number, text
from kdexp.config.sources import check_data, check_model, check_tokenizer, shapes
from kdexp.losses.options import BalancerOptions, KDLossOptions


def _check_trainer(t: Any, max_positions: int) -> None:
    for key in ("max_steps", "micro_batch_size", "seq_length", "eval_interval", "eval_iters", "log_interval",
                "checkpoint_interval"):
        integer(f"trainer.{key}", getattr(t, key), ge=1)
    if t.seq_length > max_positions:
        fail("trainer.seq_length", t.seq_length, f"must be <= the models' max_position_embeddings {max_positions}")
    integer("trainer.warmup_steps", t.warmup_steps, ge=0)
    if t.warmup_steps > t.max_steps:
        fail("trainer.warmup_steps", t.warmup_steps, f"must be in [0, trainer.max_steps={t.max_steps}]")
    number("trainer.lr", t.lr, gt=0)
    number("trainer.min_lr", t.min_lr, ge=0)
    if t.min_lr > t.lr:
        fail("trainer.min_lr", t.min_lr, f"must be in [0, trainer.lr={t.lr}]")
    number("trainer.weight_decay", t.weight_decay, ge=0)
    number("trainer.grad_clip", t.grad_clip, ge=0)  # 0 disables clipping
    integer("trainer.seed", t.seed, ge=0, lt=2**32)
    integer("trainer.skip_nonfinite", t.skip_nonfinite, ge=0)
    for key in ("reuse_finished", "export_hf"):
        if not isinstance(getattr(t, key), bool):
            fail(f"trainer.{key}", getattr(t, key), "must be true or false")


def _check_parallel(cfg: Any, sizes: dict, vocab: Optional[int]) -> None:
    tp = cfg.parallel.tensor
    integer("parallel.tensor", tp, ge=1)
    if cfg.parallel.pipeline != 1:
        fail("parallel.pipeline", cfg.parallel.pipeline, "must be 1 (pipeline parallelism is not supported yet)")
    for role, (_, heads, kv, _) in sizes.items():
        for what, n in (("attention heads", heads), ("key/value heads", kv)):
            if n % tp:
                fail("parallel.tensor", tp, f"must divide the {role}'s {n} {what}")
    if vocab is not None and vocab % tp:
        fail("parallel.tensor", tp, f"must divide the vocabulary size {vocab}")
    job = launch.launch_env()  # a lone process (e.g. printing or planning a TP=2 run) has no world size to check
    if job.source != "local" and job.world_size % tp:
        fail("parallel.tensor", tp, f"must divide the world size {job.world_size} (launched by {job.source})")


_WANDB_MODES = ("online", "offline", "disabled", None)


def _check_logger(cfg: Any) -> None:
    lg, w = cfg.logger, cfg.logger.wandb
    text("logger.name", lg.name)
    if not isinstance(w.enabled, bool):
        fail("logger.wandb.enabled", w.enabled, "must be true or false")
    choice("logger.wandb.mode", w.mode, _WANDB_MODES)
    text("logger.wandb.project", w.project)
    text("logger.wandb.entity", w.entity, none_ok=True)
    text("logger.wandb.group", w.group, none_ok=True)
    for tag in w.tags:
        if not isinstance(tag, str) or not 0 < len(tag) <= 64:
            fail("logger.wandb.tags", list(w.tags), f"each tag must be a string of 1 to 64 characters, not {tag!r}")
    if not w.enabled:
        for key in ("mode", "entity", "group"):
            if getattr(w, key) is not None:
                fail(f"logger.wandb.{key}", getattr(w, key), "W&B is off (logger=none), so it would be ignored: drop it")


def _check_paths(cfg: Any) -> None:
    for key in ("cache", "index"):
        value = getattr(cfg.paths, key)
        text(f"paths.{key}", value)
        p = Path(value).expanduser()
        if p.exists() and not p.is_dir():
            fail(f"paths.{key}", value, "must be a directory (or not exist yet), not a file")
    text("experiment_arm", cfg.experiment_arm, none_ok=True)


def validate(cfg: Any) -> None:
    """Check every value before W&B, data, teacher, model or any process group is built; a ``ValueError`` whose one
    line names the key, the value and what it must be."""
    unresolved(cfg)
    check_data(cfg)
    check_model(cfg)
    sizes = shapes(cfg)
    teacher_vocab, student_vocab = sizes["teacher"][0], sizes["student"][0]
    if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
        raise ValueError(f"model.teacher vocabulary ({teacher_vocab}) and model.student vocabulary ({student_vocab}) "
                         "differ: logit distillation needs one shared vocabulary")
    check_tokenizer(cfg)
    KDLossOptions.from_config(cfg.loss).check(teacher_vocab, prefix="loss.")  # the loss's own rules
    BalancerOptions.from_config(cfg.balancer).check(prefix="balancer.")
    _check_trainer(cfg.trainer, min(s[3] for s in sizes.values()))
    _check_parallel(cfg, sizes, teacher_vocab)
    _check_logger(cfg)
    _check_paths(cfg)
