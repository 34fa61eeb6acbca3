"""The distillation loop: teacher forward (no grad) -> student forward -> LM + KD loss -> balancer -> AdamW.

Eval every ``trainer.eval_interval`` steps and at the end; checkpoints every ``trainer.checkpoint_interval`` steps and at
the end. A rerun in the same run dir resumes from the latest checkpoint and reproduces the uninterrupted run: the data
stream restarts at the checkpoint's sample offset and the interval accumulators are part of the checkpoint.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from kdexp import distributed, models
from kdexp.data import batches, prepare
from kdexp.losses import make_balancer
from kdexp.track.metrics import IntervalMeter, MetricsFile, Progress, console_line, eval_line
from kdexp.train import checkpoint, objectives, optim
from kdexp.train.teacher import DTYPES, get_teacher

log = logging.getLogger("kdexp")


def balancer_from(cfg):
    b = cfg.balancer
    if b.name == "alpha":
        return make_balancer("alpha", alpha=b.alpha)
    kwargs = {k: getattr(b, k) for k in ("kd_loss_scale", "skip_lm_loss") if getattr(b, k) is not None}
    return make_balancer("dynamic", **kwargs)


def build_student(cfg, vocab_size: int) -> torch.nn.Module:
    dtype = DTYPES[cfg.model.params_dtype]
    if cfg.model.student_path is not None:
        return models.load_hf(cfg.model.student_path, params_dtype=dtype)
    name = cfg.model.student
    spec = models.get_spec(name, vocab_size=vocab_size) if name.startswith("tiny") else models.QWEN3_SIZES[name]
    return models.build(spec, params_dtype=dtype)


@torch.no_grad()
def evaluate(student, teacher, val_batches: list[dict]) -> dict[str, float]:
    """val/lm_loss, val/kl_to_teacher (full-vocabulary forward KL, T=1), val/top1_agreement; averaged over DP."""
    st = distributed.state()
    student.eval()
    sums = torch.zeros(3, device=st.device)
    for batch in val_batches:
        t_logits = models.vocab_parallel_logits(teacher, batch["tokens"])
        s_logits = models.vocab_parallel_logits(student, batch["tokens"])
        mask = batch["loss_mask"]
        sums += torch.stack([objectives.full_kl(s_logits, t_logits, mask),
                             objectives.top1_agreement(s_logits, t_logits, mask),
                             objectives.lm_loss(s_logits, batch["labels"], mask)])
    student.train()
    if st.dp_size > 1:
        dist.all_reduce(sums, group=distributed.dp_group())
        sums /= st.dp_size
    kl, agree, lm = (sums / max(1, len(val_batches))).tolist()
    return {"val/lm_loss": lm, "val/kl_to_teacher": kl, "val/top1_agreement": agree}


def train_step(student, teacher, batch, balancer, cfg, needs_lm: bool):
    with torch.no_grad():
        t_logits = models.vocab_parallel_logits(teacher, batch["tokens"])
    s_logits = models.vocab_parallel_logits(student, batch["tokens"])
    mask = batch["loss_mask"]
    kd, stats = objectives.kd_loss(s_logits, t_logits, mask, cfg.loss)
    if needs_lm:
        lm = objectives.lm_loss(s_logits, batch["labels"], mask)
    else:  # alpha == 1: the LM loss stays out of the graph; logged from a detached copy
        with torch.no_grad():
            lm_logged = objectives.lm_loss(s_logits.detach(), batch["labels"], mask)
        lm = None
    total, _ = balancer(lm, kd)
    total.backward()
    return {"train/loss": total.detach(), "train/lm_loss": (lm if lm is not None else lm_logged).detach(),
            "train/kd_loss": kd.detach(), **{f"train/{k}": v for k, v in stats.items()}}


def distill(cfg, run_dir: Path, *, config_hash: str, resume_from: Optional[Path] = None,
            wandb_logger=None) -> tuple[dict, torch.nn.Module]:
    """Train the student; returns (final metrics, the student). Checkpoints of another config are not resumed."""
    st = distributed.state()
    t = cfg.trainer
    rank0 = st.rank == 0
    global_batch = t.micro_batch_size * st.dp_size
    data = prepare(cfg.data, seq_length=t.seq_length, cache_dir=cfg.paths.cache, seed=t.seed,
                   train_samples=max(t.max_steps, cfg.model.teacher_pretrain_steps) * global_batch,
                   val_samples=t.eval_iters * global_batch,
                   tokenizer_path=cfg.data.tokenizer or cfg.model.teacher_path)
    teacher = get_teacher(cfg, data)
    distributed.reseed(t.seed)  # the student's init must not depend on whether the teacher was just trained
    student = build_student(cfg, data.vocab_size)
    student.train()
    opt = optim.make_optimizer(student, lr=t.lr, weight_decay=t.weight_decay)
    balancer = balancer_from(cfg)
    needs_lm = balancer.needs_lm_loss
    meter = IntervalMeter()
    last_train: dict[str, float] = {}
    last_eval: dict[str, float] = {}

    ckpt_dir = Path(run_dir) / "checkpoints"
    state = checkpoint.load(ckpt_dir)
    if state is None and resume_from is not None:
        state = checkpoint.load(Path(resume_from) / "checkpoints")
    if state is not None and state.get("config_hash") != config_hash:
        if rank0:
            log.warning("not resuming from %s: it was written by another config", ckpt_dir)
        state = None
    start = 0
    if state is not None:
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        meter.load_state_dict(state["meter"], st.device)
        last_train, last_eval, start = state["last_train"], state["last_eval"], state["step"]
        if rank0:
            log.info("resuming from step %d (%s)", start, ckpt_dir if resume_from is None else resume_from)
    metrics = MetricsFile(Path(run_dir) / "metrics.jsonl", enabled=rank0, resume_step=start)

    val_stream = batches(data.val_ds, micro_batch_size=t.micro_batch_size, dp_rank=st.dp_rank, dp_size=st.dp_size)
    val_batches = [objectives.batch_to(next(val_stream), st.device) for _ in range(t.eval_iters)]
    stream = batches(data.train_ds, micro_batch_size=t.micro_batch_size, dp_rank=st.dp_rank, dp_size=st.dp_size,
                     start_sample=start * global_batch)
    tokens_per_step = global_batch * t.seq_length
    progress = Progress(t.max_steps, rank0)
    interval_start, interval_steps, run_start = time.perf_counter(), 0, time.perf_counter()

    def emit(record: dict) -> None:
        metrics.write(record)
        if wandb_logger is not None:
            wandb_logger.log(record, record["step"])

    fault_at = int(os.environ.get("KDEXP_FAULT_AT_STEP", "0"))
    for step in range(start, t.max_steps):
        batch = objectives.batch_to(next(stream), st.device)
        lr = optim.lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup=t.warmup_steps, total=t.max_steps)
        optim.set_lr(opt, lr)
        opt.zero_grad(set_to_none=True)
        parts = train_step(student, teacher, batch, balancer, cfg, needs_lm)
        optim.average_gradients(student)
        parts["train/grad_norm"] = optim.clip_gradients(student, t.grad_clip)
        opt.step()
        meter.add(parts)
        interval_steps += 1
        done = step + 1
        progress.update(done)
        if done % t.log_interval == 0 or done == t.max_steps:
            elapsed = time.perf_counter() - interval_start
            last_train = {**meter.averages(), "train/lr": lr,
                          "perf/step_ms": 1000.0 * elapsed / interval_steps,
                          "perf/tokens_per_s": tokens_per_step * interval_steps / max(elapsed, 1e-9)}
            meter.reset()
            if rank0:
                eta = (time.perf_counter() - run_start) / (done - start) * (t.max_steps - done)
                log.info(console_line(done, t.max_steps, last_train, eta))
            emit({"step": done, "kind": "train", **last_train})
        if done % t.eval_interval == 0 or done == t.max_steps:
            last_eval = evaluate(student, teacher, val_batches)
            if rank0:
                log.info(eval_line(done, last_eval))
            emit({"step": done, "kind": "val", **last_eval})
        if done % t.checkpoint_interval == 0 or done == t.max_steps:
            checkpoint.save(ckpt_dir, done, {
                "model": student.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                "meter": meter.state_dict(), "last_train": last_train, "last_eval": last_eval, "step": done,
                "config_hash": config_hash})
        if fault_at == done:  # fault injection for the resume test: die like a preempted node
            os.kill(os.getpid(), signal.SIGKILL)
        if done % t.log_interval == 0 or done == t.max_steps:
            interval_start, interval_steps = time.perf_counter(), 0  # eval and checkpoint time are not step time
    progress.close()
    final = {**{k: v for k, v in last_train.items() if not k.startswith("train/lr")}, **last_eval}
    return final, student
