"""The distillation loop: teacher forward (no grad) -> student forward -> LM + KD loss -> balancer -> AdamW.

``setup(cfg)`` builds what a step needs (data, teacher, reseed, student, optimizer, balancer); the trainer and the step
benchmark both use it. Eval every ``trainer.eval_interval`` steps and at the end; checkpoints every
``trainer.checkpoint_interval`` steps and at the end. A rerun in the same run dir resumes from the latest intact
checkpoint and reproduces the uninterrupted run: the data stream restarts at the checkpoint's sample offset and the
interval accumulators are part of the checkpoint. SIGTERM / SIGUSR1 / SIGUSR2 save the current step at its end and
stop the run (kdexp.train.signals). A non-finite step is skipped or stops the run (kdexp.train.step).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from kdexp import assets, distributed, models
from kdexp.config import precision
from kdexp.config.checks import accumulation_steps
from kdexp.config.rollout import positions_per_sample
from kdexp.data import batches, prepare, tokenize_prompts
from kdexp.track import faults, records
from kdexp.track.metrics import IntervalMeter, MetricsFile, Progress, console_line, eval_line
from kdexp import objective
from kdexp.train import checkpoint, megatron_optim, optim, signals
from kdexp.train.batches import batch_to
from kdexp.train.step import NonFiniteGuard, StepDriver, evaluate, optimizer_tensors
from kdexp.train.teacher import get_teacher, teacher_identity

log = logging.getLogger("kdexp")


def run_formats(cfg) -> precision.Formats:
    """This process's numeric formats (kdexp.config.precision: the rule kdexp.plan sizes by)."""
    return precision.of(cfg, cuda=torch.cuda.is_available())


def student_dtype(cfg) -> torch.dtype:
    """The student's (and the teacher's) weight dtype: bf16 under trainer.precision=bf16 or
    model.params_dtype=bfloat16 (fp32 masters in the optimizer), else fp32."""
    return models.DTYPES[run_formats(cfg).weights]


def build_student(cfg, vocab_size: int) -> torch.nn.Module:
    dtype = student_dtype(cfg)
    memory = {"recompute": cfg.trainer.recompute, "sequence_parallel": cfg.parallel.sequence,
              "attention": cfg.model.attention}
    real = models.vocab_alignment(cfg).get("real_vocab")  # model.vocab_alignment=tokenizer: padded ids -inf
    if cfg.model.student_path is not None:
        return models.load_hf(cfg.model.student_path, params_dtype=dtype, real_vocab=real, **memory)
    name = models.size_key(cfg.model.student)
    spec = models.get_spec(name, vocab_size=vocab_size) if name.startswith("tiny") else models.QWEN3_SIZES[name]
    model = models.build(spec, params_dtype=dtype, **memory)
    return model if real is None else models.mask_padded_vocab(model, real)


def build_optimizer(cfg, student: torch.nn.Module):
    """The student's optimizer in the formats kdexp.config.precision decides: megatron's DDP + (distributed) optimizer
    on CUDA, else kdexp.train.optim's AdamW (with fp32 masters for bf16 weights)."""
    t, formats = cfg.trainer, run_formats(cfg)
    if megatron_optim.uses_megatron(t.optimizer):
        return megatron_optim.MegatronOptimizer(student, t, formats)
    return optim.make_optimizer(student, lr=t.lr, weight_decay=t.weight_decay, master_weights=formats.master is not None)


@dataclasses.dataclass
class Setup:
    data: Any
    teacher: torch.nn.Module
    student: torch.nn.Module
    optimizer: torch.optim.Optimizer
    balancer: Any
    objective: Any = None  # kdexp.objective.Objective: the KD loss, its teacher source, the output layer
    accumulation: int = 1  # micro-batches per optimizer step on each rank
    global_batch: int = 1  # samples per optimizer step over all DP ranks


def micro_batches(stream, accumulation: int, micro_batch_size: int, device) -> list[dict]:
    """The next global batch's share of this rank (one item of `stream`, micro x accumulation contiguous samples),
    cut into `accumulation` micro-batches in sample order, on the device."""
    share = batch_to(next(stream), device)
    if accumulation == 1:
        return [share]
    return [{k: v[i * micro_batch_size:(i + 1) * micro_batch_size] for k, v in share.items()}
            for i in range(accumulation)]


def train_order(cfg, setup_: "Setup"):
    """The training stream: max_steps global batches over the data.seed windows, read in trainer.seed's order."""
    return setup_.data.read_order(cfg.trainer.max_steps * setup_.global_batch, cfg.trainer.seed)


def data_stream(ds, cfg, setup_: "Setup", start_step: int = 0):
    """This rank's shares of the global batches of `ds` (`train_order`, or the validation set in its own order) from
    step `start_step` on: rank r takes the r-th contiguous slice of micro x accumulation samples of each global batch,
    so micro 2 x 4 accumulation steps reads exactly the samples micro 8 x 1 reads, on every DP size, and a resume
    restarts at position start_step x global batch."""
    st = distributed.state()
    return batches(ds, micro_batch_size=cfg.trainer.micro_batch_size * setup_.accumulation, dp_rank=st.dp_rank,
                   dp_size=st.dp_size, start_sample=start_step * setup_.global_batch)


def setup(cfg, *, make_teacher: Callable = get_teacher) -> Setup:
    """Data, the frozen teacher, the objective's teacher source (a cache is built here), then (reseeded) the
    student, its optimizer, the balancer and the objective. `make_teacher(cfg, data)` -> the frozen teacher model:
    the seam for a benchmark's randomly initialised teacher at real shapes (kdexp.bench.gpu_scale)."""
    st = distributed.state()
    t = cfg.trainer
    accumulation = accumulation_steps(t.global_batch_size, t.micro_batch_size, st.dp_size)
    global_batch = t.micro_batch_size * st.dp_size * accumulation
    data = prepare(cfg.data, seq_length=t.seq_length, cache_dir=cfg.paths.cache, seed=cfg.data.seed,
                   train_samples=t.max_steps * global_batch, val_samples=t.eval_iters * global_batch,
                   tokenizer_path=assets.tokenizer_source(cfg)[1])
    # rollout.prompts' tokens are checked with the tokenizer, before any model is built (a ConfigError: exit 2)
    prompts = None if cfg.rollout.prompts is None else \
        tokenize_prompts(cfg.rollout.prompts, data.tokenizer, int(cfg.rollout.prompt_tokens))
    teacher = make_teacher(cfg, data)
    if next(teacher.parameters()).dtype != student_dtype(cfg):
        teacher = models.cast(teacher, student_dtype(cfg))  # frozen: no grads, no optimizer state
    balancer = objective.build_balancer(cfg.balancer)
    # Before the student: a cached teacher's one pass into the cache runs here (skipped when the cache exists). The
    # teacher's identity keys that cache; asked only then (a make_teacher stand-in may have no checkpoint to name).
    kd = objective.build(cfg, data, teacher, balancer,
                         identify_teacher=functools.partial(teacher_identity, cfg, data), prompts=prompts)
    distributed.reseed(t.seed)  # the student's init must not depend on whether the teacher was just trained
    student = build_student(cfg, data.vocab_size)
    objective.attach_intermediate(student, cfg.loss, teacher.kdexp_spec.hidden_size)  # before its optimizer
    student.train()
    opt = build_optimizer(cfg, student)
    return Setup(data=data, teacher=teacher, student=student, optimizer=opt, balancer=balancer, objective=kd,
                 accumulation=accumulation, global_batch=global_batch)


def _final(last_train: dict, last_eval: dict) -> dict:
    return {**{k: v for k, v in last_train.items() if not k.startswith("train/lr")}, **last_eval}


def _history_checked(state: dict, source: Optional[Path], run_dir: Path, t) -> tuple[Optional[dict], Optional[Path]]:
    """(state, source) when the metrics.jsonl that goes with the checkpoint (this run dir's, or ``source``'s) holds
    every line logged up to the checkpoint's step; else (None, None) with one line saying so: the run trains from step
    0, so that its record holds every step once instead of a hole. Rank 0 reads, every rank is told."""
    step = state["step"]
    gap = None
    if distributed.state().rank == 0:
        lines = records.read_jsonl(Path(source or run_dir) / records.METRICS)
        gap = records.gap_line(records.missing_steps(lines, step, log_interval=t.log_interval,
                                                     eval_interval=t.eval_interval, max_steps=t.max_steps))
        if gap is not None:
            log.warning("not resuming from checkpoint step %d of %s: its %s lacks %s; training from step 0, so that "
                        "every step is logged once", step, source or run_dir, records.METRICS, gap)
    if checkpoint.from_rank0(gap) is None:
        return state, source
    return None, None


def distill(cfg, run_dir: Path, *, config_hash: str, resume_from: Optional[Path] = None,
            wandb_logger=None, make_teacher: Callable = get_teacher,
            on_resume: Optional[Callable[[Path, int], None]] = None) -> tuple[dict, torch.nn.Module]:
    """Train the student; returns (final metrics, the student), exported to run_dir/student_hf with
    trainer.export_hf. Raises kdexp.train.Diverged on a non-finite step.

    Checkpoints of another config are not resumed. `make_teacher`: as in `setup`. `on_resume(dir, step)`: told where
    the run resumed from (this run dir or `resume_from`) before it trains."""
    st = distributed.state()
    t = cfg.trainer
    rank0 = st.rank == 0
    s = setup(cfg, make_teacher=make_teacher)
    global_batch = s.global_batch
    student, opt = s.student, s.optimizer
    meter = IntervalMeter()
    last_train: dict[str, float] = {}
    last_eval: dict[str, float] = {}

    ckpt_dir = Path(run_dir) / "checkpoints"
    state, source = checkpoint.load(ckpt_dir, config_hash=config_hash), None
    if state is None and resume_from is not None:
        state = checkpoint.load(Path(resume_from) / "checkpoints", config_hash=config_hash)
        source = Path(resume_from) if state is not None else None
    if state is not None:
        state, source = _history_checked(state, source, Path(run_dir), t)
    start, saved = 0, None  # saved: the newest checkpoint step in this run dir
    guard = NonFiniteGuard(t.skip_nonfinite)
    driver = StepDriver(s, cfg, guard)
    if state is not None:
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        meter.load_state_dict(state["meter"], st.device)
        last_train, last_eval, start = state["last_train"], state["last_eval"], state["step"]
        guard.skipped = state.get("skipped", 0)
        saved = start if source is None else None
        if rank0:
            log.info("resuming from step %d (%s)", start, ckpt_dir if source is None else source)
        if on_resume is not None:
            on_resume(Path(run_dir) if source is None else source, start)
    metrics = MetricsFile(Path(run_dir) / "metrics.jsonl", enabled=rank0, resume_step=start,
                          history=None if source is None else source / "metrics.jsonl")

    # eval_iters global batches (as megatron counts eval iterations), each token-normalised over this rank's share
    val_stream = data_stream(s.data.val_ds, cfg, s)
    val_batches = [micro_batches(val_stream, s.accumulation, t.micro_batch_size, st.device)
                   for _ in range(t.eval_iters)]
    stream = data_stream(train_order(cfg, s), cfg, s, start)
    progress = Progress(t.max_steps, rank0)
    interval_start, interval_steps, run_start = time.perf_counter(), 0, time.perf_counter()
    interval_tokens = 0  # positions through the student's training forward (an on-policy step's are its rollouts')

    def emit(record: dict) -> None:
        metrics.write(record)
        if wandb_logger is not None:
            wandb_logger.log(record, record["step"])

    def save(done: int) -> int:
        guard.check_state(done, [*student.parameters(), *optimizer_tensors(opt)],
                          metrics=_final(last_train, last_eval), checkpoint=saved)
        target = checkpoint.step_dir(ckpt_dir, done)
        try:
            with faults.writing(target):
                checkpoint.save(ckpt_dir, done, {
                    "model": student.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                    "meter": meter.state_dict(), "last_train": last_train, "last_eval": last_eval, "step": done,
                    "skipped": guard.skipped, "config_hash": config_hash})
        except BaseException:
            # a save that committed nothing (a full disk, a kill) leaves no empty step dir behind
            if rank0 and target.is_dir() and not any(target.glob("tp*.json")):
                shutil.rmtree(target, ignore_errors=True)
            raise
        return done

    faults.watch_log_files()  # a full disk under run.log: one line at the next step, not a traceback per record
    # SIGTERM / SIGUSR1 / SIGUSR2 from here on: checkpoint at the step boundary, then exit (kdexp.train.signals)
    preemption = signals.Preemption().__enter__()
    try:
        for step in range(start, t.max_steps):
            done = step + 1
            batch = micro_batches(stream, s.accumulation, t.micro_batch_size, st.device)
            lr = optim.lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup=t.warmup_steps, total=t.max_steps)
            optim.set_lr(opt, lr)
            parts, finite = driver.step(step, batch, metrics=_final(last_train, last_eval), checkpoint=saved)
            if finite:
                meter.add(parts)
            interval_steps += 1
            interval_tokens += global_batch * positions_per_sample(cfg, step)
            progress.update(done)
            if done % t.log_interval == 0 or done == t.max_steps:
                elapsed = time.perf_counter() - interval_start
                averages = meter.averages()  # {} when every step of the interval was skipped
                record = {**averages, "train/lr": lr, "train/skipped_steps": guard.skipped,
                          "perf/step_ms": 1000.0 * elapsed / interval_steps,
                          "perf/tokens_per_s": interval_tokens / max(elapsed, 1e-9)}
                # a fully skipped interval keeps the last finite losses (an on-policy interval has no train/lm_loss:
                # its console line shows none rather than an older interval's)
                last_train = {**last_train, **record}
                meter.reset()
                if rank0:
                    eta = (time.perf_counter() - run_start) / (done - start) * (t.max_steps - done)
                    log.info(console_line(done, t.max_steps, record, eta) if averages else
                             f"step {done:>6d}/{t.max_steps:<6d} every step of this interval was skipped "
                             f"(non-finite; {guard.skipped} skipped in all)")
                emit({"step": done, "kind": "train", **record})
            if done % t.eval_interval == 0 or done == t.max_steps:
                values = evaluate(student, s.objective, val_batches)
                guard.check_values(done, values, "eval metrics", metrics=_final(last_train, last_eval),
                                   checkpoint=saved)
                last_eval = values
                if rank0:
                    log.info(eval_line(done, last_eval))
                emit({"step": done, "kind": "val", **last_eval})
            if done % t.checkpoint_interval == 0 or done == t.max_steps:
                saved = save(done)
            faults.raise_pending()  # run.log could not be written (a full disk): stop like any other write
            signum = preemption.agreed(st.device) if done < t.max_steps else 0  # at the last step: just finish
            if signum:
                if saved != done:
                    saved = save(done)
                line = (f"preempted by {signals.name(signum)} after step {done}/{t.max_steps}: checkpoint step "
                        f"{done} saved in {ckpt_dir}; exit status {128 + signum}; {signals.resume_hint(run_dir, signum)}")
                if rank0:
                    log.warning(line)
                preemption.stop(signum, done, line)
            if done % t.log_interval == 0 or done == t.max_steps:
                # eval and checkpoint time are not step time
                interval_start, interval_steps, interval_tokens = time.perf_counter(), 0, 0
    finally:
        preemption.__exit__()
        progress.close()
    if t.export_hf:  # every rank: save_hf gathers the TP shards, rank 0 writes
        export_hf(student, Path(run_dir) / "student_hf", s.data.tokenizer)
    return _final(last_train, last_eval), student


def export_hf(student: torch.nn.Module, path: Path, tokenizer) -> None:
    """The distilled student as a Hugging Face checkpoint that generates on its own: config.json and the weights, the
    run's tokenizer files (chat template included when it has one) and generation_config.json with its bos / eos /
    pad ids (kdexp.data.tokenizer.Tokenizer.hf_files)."""
    spec = student.kdexp_spec
    models.save_hf(student, path, spec, files=tokenizer.hf_files(max_length=spec.max_position_embeddings))
