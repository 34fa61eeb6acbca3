"""``validate(cfg)``: every value checked before W&B, data, teacher, model or any process group is built.

The per-key rules of the loss and balancer groups are the option classes' own (kdexp.losses.options); here stay the
cross-key checks that need the model or the TP size (top_k/min_k within the teacher's vocabulary, TP dividing heads
and vocabulary). A failure is a ``ValueError`` whose one line names the key, the value and the allowed range.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from kdexp.config.overrides import unknown_keys
from kdexp.config.rollout import check_rollout
from kdexp.config.rules import unresolved
from kdexp.config.sources import (ALIGNMENTS, check_alignment, check_data, check_model, check_token_files,
                                  check_tokenizer, layer_counts, shapes, tokenizer_vocab)
from kdexp.distributed import launch
from kdexp.losses.options import LOSS_NAMES, BalancerOptions, KDLossOptions, LossName, SampledKDOptions, \
    check_intermediate, cuts
from kdexp.rules import choice, fail, integer, number, text


PRECISIONS = ("fp32", "bf16")
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("auto", "torch", "megatron")


def accumulation_steps(global_batch_size: Optional[int], micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per optimizer step on each DP rank: global / (micro x DP); None = 1. The one rule for
    trainer.global_batch_size, checked by validate (when the world size is known there) and by the trainer."""
    if global_batch_size is None:
        return 1
    integer("trainer.global_batch_size", global_batch_size, ge=1, none_ok=True)
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        fail("trainer.global_batch_size", global_batch_size,
             f"must be a multiple of trainer.micro_batch_size x data-parallel size = {micro_batch_size} x {dp_size}"
             f" = {per_step}")
    return global_batch_size // per_step


def _world_size() -> Optional[int]:
    """The launcher's world size (kdexp.distributed.launch: torchrun, submitit, an srun step); None for a lone
    process, e.g. one printing or planning a TP=2 run."""
    job = launch.launch_env()
    return None if job.source == "local" else job.world_size


def _check_scale(cfg: Any) -> None:
    t, tp = cfg.trainer, cfg.parallel.tensor
    world = _world_size()
    accumulation_steps(t.global_batch_size, t.micro_batch_size, world // tp if world and world % tp == 0 else 1)
    choice("trainer.precision", t.precision, PRECISIONS)
    choice("trainer.recompute", t.recompute, RECOMPUTE)
    choice("trainer.optimizer", t.optimizer, OPTIMIZERS)
    for key in ("distributed_optimizer",):
        if not isinstance(getattr(t, key), bool):
            fail(f"trainer.{key}", getattr(t, key), "must be true or false")
    if t.distributed_optimizer and t.optimizer == "torch":
        fail("trainer.distributed_optimizer", True, "needs the megatron optimizer (trainer.optimizer=auto on CUDA, "
             "or megatron); trainer.optimizer=torch has no sharded optimizer state")
    if not isinstance(cfg.parallel.sequence, bool):
        fail("parallel.sequence", cfg.parallel.sequence, "must be true or false")
    if cfg.parallel.sequence and tp == 1:
        fail("parallel.sequence", True, "needs parallel.tensor > 1 (sequence parallelism shards over the TP group)")
    if cfg.parallel.sequence and t.seq_length % tp:
        fail("parallel.sequence", True, f"needs trainer.seq_length={t.seq_length} divisible by parallel.tensor={tp}")


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
    if t.gpu_memory_gb is not None:
        number("trainer.gpu_memory_gb", t.gpu_memory_gb, gt=0)
    number("trainer.gpu_peak_tflops", t.gpu_peak_tflops, gt=0)
    for key in ("reuse_finished", "export_hf", "overwrite"):
        if not isinstance(getattr(t, key), bool):
            fail(f"trainer.{key}", getattr(t, key), "must be true or false")


TEACHERS = ("online", "cached")
TEACHER_VALUES = ("float32", "bfloat16", "float16")
TEACHER_STORES = ("topk", "sampled", "hidden")  # kdexp.teacher.format.STORES  # kdexp.teacher.format.VALUE_DTYPES (no numpy/torch import here)


def _check_teacher(cfg: Any, vocab: Optional[int]) -> None:
    """teacher.*: its own values, then what a cached teacher can serve of the loss (cached temperatures; top-K_max
    only, or a nucleus that fits in it, unless loss.samples makes it a cache of sampled draws)."""
    tc, loss = cfg.teacher, cfg.loss
    choice("teacher.name", tc.name, TEACHERS)
    integer("teacher.k_max", tc.k_max, ge=1)
    if vocab is not None and tc.k_max > vocab:
        fail("teacher.k_max", tc.k_max, f"must be in [1, the vocabulary size {vocab}]")
    temps = list(tc.temperatures)
    if not temps:
        fail("teacher.temperatures", temps, "must list at least one temperature")
    for t in temps:
        number("teacher.temperatures", t, gt=0)
    if len(set(float(t) for t in temps)) != len(temps):
        fail("teacher.temperatures", temps, "must not repeat a temperature")
    choice("teacher.dtype", tc.dtype, TEACHER_VALUES)
    integer("teacher.shard_samples", tc.shard_samples, ge=1)
    text("teacher.path", tc.path, none_ok=True)
    choice("teacher.store", tc.store, (None, *TEACHER_STORES))
    if tc.name != "cached" or tc.store == "hidden":  # the hidden states serve every loss and temperature
        return
    if tc.store == "sampled" and loss.samples is None:
        fail("teacher.store", tc.store, "needs loss.samples (sampled KD, e.g. loss=sampled): a sampled store holds its "
                                        "draws; use teacher.store=topk or hidden for this loss")
    if tc.store == "topk" and loss.samples is not None:
        fail("teacher.store", tc.store, "cannot serve sampled KD (loss.samples is set): use teacher.store=sampled "
                                        "(the draws) or hidden")
    if float(loss.temperature) not in [float(t) for t in temps]:
        fail("loss.temperature", loss.temperature, f"must be one of the cached teacher.temperatures {temps} with "
                                                   "teacher=cached (add it to teacher.temperatures)")
    if loss.samples is not None:  # a "sampled" cache of the draws: teacher.k_max and loss.top_k play no part
        return
    if loss.top_k is None and not cuts(loss.top_p):
        fail("loss.top_k", None, f"must be set with teacher=cached unless loss.top_p cuts a nucleus: the cache holds "
                                 f"only the teacher's top-{tc.k_max} (teacher.k_max), so dense KD cannot be served; "
                                 f"set loss.top_k in [1, {tc.k_max}] or loss.top_p < 1, or use teacher=online")
    if loss.top_k is None:  # a true nucleus: served while each token's fits in its top-K_max (checked per batch)
        if loss.min_k > tc.k_max:
            fail("loss.min_k", loss.min_k, f"must be in [1, teacher.k_max={tc.k_max}] with teacher=cached")
        return
    if loss.top_k > tc.k_max:
        fail("loss.top_k", loss.top_k, f"must be in [1, teacher.k_max={tc.k_max}] with teacher=cached (raise "
                                       "teacher.k_max to cache more)")


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
    world = _world_size()
    if world and world % tp:
        fail("parallel.tensor", tp, f"must divide the world size {world} (launched by {launch.launch_env().source})")


def check_launch(cfg: Any) -> None:
    """The processes this run was launched with can hold its tensor-parallel group. kdexp.run calls it (validate
    does not: a lone process may print or plan a TP=2 run). One process asked for TP > 1 is told how to launch."""
    tp = cfg.parallel.tensor
    job = launch.launch_env()
    if tp > 1 and job.world_size == 1:
        fail("parallel.tensor", tp, f"needs {tp} processes (one per tensor-parallel rank) and this is one process: "
             f"launch with `torchrun --nproc-per-node {tp} -m kdexp.run ...`, as {tp} SLURM tasks (`srun --ntasks "
             f"{tp} python -m kdexp.run ...`), or with hydra/launcher=slurm_gpu hydra.launcher.tasks_per_node={tp}")
    if job.world_size % tp:
        fail("parallel.tensor", tp, f"must divide the world size {job.world_size} (launched by {job.source})")
    if cfg.trainer.optimizer == "megatron":  # kdexp.train.megatron_optim.uses_megatron's rule, before any work
        import torch

        if not torch.cuda.is_available():
            fail("trainer.optimizer", "megatron", "needs CUDA (megatron-core's optimizers); use trainer.optimizer=auto "
                 "or torch on a CPU machine")


# A shipped loss name is a promise (kdexp.losses.options.LOSS_NAMES): a set of options that contradicts it is an
# error, rather than a name that follows the options: the name is what the user chose, what the report tables and
# W&B group by, and a run named `dense` that truncates (or one named `topk` without a Top-K) is a wrong job whichever
# name it gets; the error says which option gives that loss. A nucleus inside a Top-K keeps the name `topk` (the
# Top-K bounds it; `loss.top_p=0.8,0.9` on the default is the cached-teacher sweep), and a registered loss promises
# nothing.
def _loss_option(loss: Any) -> str:
    """The shipped loss option whose promise these options keep (the first that fits)."""
    for name, promise in LOSS_NAMES.items():
        if (promise.need or promise.unset) and _keeps_promise(loss, promise) is None:
            return name
    return "top_p"


def _keeps_promise(loss: Any, promise: LossName) -> Optional[str]:
    """None when the options keep what the loss name promises, else the key that breaks it."""

    def is_set(key: str) -> bool:
        value = getattr(loss, key)
        return cuts(value) if key == "top_p" else value is not None

    for key in promise.need:
        if not is_set(key):
            return key
    for key in promise.unset:
        if is_set(key):
            return key
    if promise.normalization is not None and loss.normalization != promise.normalization:
        return "normalization"
    return None


def _check_loss_name(loss: Any) -> None:
    if loss.name not in LOSS_NAMES:
        fail("loss.name", loss.name, f"must be one of {', '.join(LOSS_NAMES)} (conf/loss/<name>.yaml; a new loss "
             "registers its name with kdexp.objective.register_loss)")


def _check_loss_promise(loss: Any) -> None:
    name = loss.name
    promise = LOSS_NAMES[name]
    key = _keeps_promise(loss, promise)
    if key is not None:
        fits = _loss_option(loss)
        undo = f"set loss.{key}" if key in promise.need else f"leave loss.{key} at loss={name}'s value"
        fail(f"loss.{key}", getattr(loss, key), f"contradicts loss={name} (its name would no longer say what it "
             f"trains): these options make a loss={fits} loss; choose loss={fits} (with its options), or {undo}")


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
    integer("launch.local_parallel", cfg.launch.local_parallel, ge=1, none_ok=True)
    integer("launch.cpu_threads", cfg.launch.cpu_threads, ge=1, none_ok=True)


def _check_intermediate(cfg: Any) -> None:
    pairs = cfg.loss.intermediate
    if not pairs:
        return
    if cfg.teacher.name == "cached":
        fail("loss.intermediate", list(pairs), "needs the online teacher's hidden states (a teacher cache stores "
             "logits only): use teacher=online, or drop loss.intermediate")
    layers = layer_counts(cfg)
    check_intermediate(pairs, layers["student"], layers["teacher"], prefix="loss.")


def validate(cfg: Any) -> None:
    """Check every value before W&B, data, teacher, model or any process group is built; a ``ValueError`` whose one
    line names the key, the value and what it must be."""
    unknown_keys(cfg)  # a +key the schema does not know (the command line's are refused before composing)
    unresolved(cfg)
    _check_loss_name(cfg.loss)
    check_data(cfg)
    check_model(cfg)
    sizes = shapes(cfg)
    teacher_vocab, student_vocab = sizes["teacher"][0], sizes["student"][0]
    choice("model.vocab_alignment", cfg.model.vocab_alignment, ALIGNMENTS)
    exact = cfg.model.vocab_alignment == "exact"
    both = teacher_vocab is not None and student_vocab is not None
    if both and exact and teacher_vocab != student_vocab:  # needs no tokenizer: said before the tokenizer's checks
        check_alignment("exact", teacher_vocab, student_vocab, None)
    check_tokenizer(cfg)
    check_token_files(cfg, sizes)
    if both and not exact:
        check_alignment(cfg.model.vocab_alignment, teacher_vocab, student_vocab, tokenizer_vocab(cfg))
        teacher_vocab = student_vocab  # the teacher is loaded with the student's rows
    kd = KDLossOptions.from_config(cfg.loss).check(teacher_vocab, prefix="loss.")  # the loss's own rules
    if not isinstance(cfg.loss.fused_head, bool) and cfg.loss.fused_head != "auto":
        fail("loss.fused_head", cfg.loss.fused_head, "must be auto, true or false")
    SampledKDOptions.from_config(cfg.loss).check(kd, prefix="loss.")
    _check_loss_promise(cfg.loss)
    _check_intermediate(cfg)
    BalancerOptions.from_config(cfg.balancer).check(prefix="balancer.")
    _check_trainer(cfg.trainer, min(s[3] for s in sizes.values()))
    check_rollout(cfg, min(s[3] for s in sizes.values()))
    if cfg.model.teacher_pretrain_seq_length > sizes["teacher"][3]:
        fail("model.teacher_pretrain_seq_length", cfg.model.teacher_pretrain_seq_length,
             f"must be <= the teacher's max_position_embeddings {sizes['teacher'][3]}")
    _check_parallel(cfg, sizes, teacher_vocab)
    _check_scale(cfg)
    _check_teacher(cfg, teacher_vocab)
    _check_logger(cfg)
    _check_paths(cfg)
