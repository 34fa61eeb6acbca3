"""The real-shape part of the GPU check: a distillation at Qwen3-1.7B -> Qwen3-0.6B shapes, measured beside the plan.

Random init (no weights exist on a check machine): the trainer's own setup (kdexp.train.loop.setup: data, student,
optimizer, balancer) with the teacher built from its QWEN3_SIZES shape instead of loaded, then the trainer's own step
(kdexp.train.step.StepDriver: train_step, DP averaging, clipping, the non-finite guard, the optimizer step) on the embedded corpus
re-tokenised by a small BPE (token ids below the models' 151,936-entry vocabulary; the logits are full width).
It times `steps` KD steps, then LM-only steps (the student alone, no teacher: what training without distillation
costs), and reports tokens/s, MFU, torch.cuda.max_memory_allocated of each phase and kdexp.plan's prediction.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}  # dense bf16


def _schema_has(node_cls, key: str) -> bool:
    return key in {f.name for f in dataclasses.fields(node_cls)}


def compose_cfg(teacher: str, student: str, *, seq: int, micro: int, steps: int, recompute: str,
                extra: tuple = ()) -> tuple:
    """(cfg, notes): the run's config; trainer.precision=bf16 and trainer.recompute where the schema has them, else
    model.params_dtype=bfloat16 alone (pure bf16) and no recompute, said in the notes."""
    from hydra import compose, initialize_config_module

    from kdexp.config.schema import TrainerConfig

    notes = []
    over = ["model=qwen3", f"model.teacher={teacher}", f"model.student={student}", "model.params_dtype=bfloat16",
            f"trainer.seq_length={seq}", f"trainer.micro_batch_size={micro}", f"trainer.max_steps={steps}",
            "trainer.warmup_steps=0", "logger=none", "data.max_chars=400000", "data.vocab_size=2048"]
    if _schema_has(TrainerConfig, "precision"):
        over.append("trainer.precision=bf16")
    else:
        notes.append("trainer.precision is not in this schema: pure bf16 (model.params_dtype=bfloat16)")
    if _schema_has(TrainerConfig, "recompute"):
        over.append(f"trainer.recompute={recompute}")
    elif recompute != "none":
        notes.append(f"trainer.recompute is not in this schema: --recompute {recompute} ignored")
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*over, *extra]), notes


def random_teacher(cfg, data):
    """A frozen teacher of cfg's shape with random weights: a ``make_teacher`` for loop.setup where what is measured
    (speed, memory, numerics of the head) does not need a trained one."""
    from kdexp import models
    from kdexp.train.teacher import freeze

    name = cfg.model.teacher
    spec = models.get_spec(name, vocab_size=data.vocab_size) if name.startswith("tiny") else models.QWEN3_SIZES[name]
    return freeze(models.build(spec, params_dtype=models.DTYPES[cfg.model.params_dtype], attention=cfg.model.attention))


def _peak_tflops(cfg, device) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_TFLOPS.items():
            if key in name:
                return value
    return float(cfg.trainer.gpu_peak_tflops)


def run(teacher: str = "1.7b", student: str = "0.6b", *, steps: int = 50, lm_steps: int = 10, warmup: int = 3,
        seq: int = 4096, micro: int = 1, recompute: str = "none", extra: tuple = ()) -> dict:
    from kdexp import distributed
    from kdexp.data import batches
    from kdexp.plan import GiB, make_plan
    from kdexp.train import loop, optim
    from kdexp.train.batches import batch_to
    from kdexp.train.step import StepDriver

    cfg, notes = compose_cfg(teacher, student, seq=seq, micro=micro, steps=max(steps, 1), recompute=recompute,
                             extra=extra)
    st = distributed.initialize(tensor_parallel=int(cfg.parallel.tensor), seed=cfg.trainer.seed)
    s = loop.setup(cfg, make_teacher=random_teacher)
    t = cfg.trainer
    driver = StepDriver(s, cfg)
    stream = iter(())

    def batch():
        nonlocal stream
        try:
            return batch_to(next(stream), st.device)
        except StopIteration:  # more steps than one pass: start the data over
            stream = batches(s.data.train_ds, micro_batch_size=t.micro_batch_size, dp_rank=st.dp_rank,
                             dp_size=st.dp_size)
            return batch_to(next(stream), st.device)

    def kd_step(step):
        return driver.step(step - 1, batch())[0]["train/loss"]

    def lm_step(step):
        return driver.lm_step(step - 1, batch())[0]["train/loss"]

    def phase(fn, n):
        cuda = st.device.type == "cuda"
        for i in range(warmup):  # first steps allocate the optimizer state and warm the kernels
            fn(i + 1)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for i in range(n):
            start = time.perf_counter()
            losses.append(fn(warmup + i + 1))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / GiB if cuda else None
        return statistics.median(times), peak, [float(x) for x in losses]

    tokens = t.micro_batch_size * t.seq_length * st.dp_size
    plan = make_plan(cfg, gpus=st.world_size)
    peak_flops = _peak_tflops(cfg, st.device) * 1e12
    kd_s, kd_peak, kd_losses = phase(kd_step, steps)
    lm_s, lm_peak, _ = phase(lm_step, lm_steps)
    kd_tps, lm_tps = tokens / kd_s, tokens / lm_s
    # What the loop really keeps, beside the plan's assumption for trainer.precision (fp32 grads and master state)
    grads = {str(g.dtype) for p in optim.grad_params(s.student, s.optimizer)
             for g in [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad] if g is not None}
    state = getattr(s.optimizer, "state", {})
    opt_dtypes = {str(v.dtype) for d in (state.values() if hasattr(state, "values") else ()) for v in d.values()
                  if torch.is_tensor(v) and v.dim() > 0}
    per_gpu = 1.0 / st.world_size
    return {
        "teacher": cfg.model.teacher, "student": cfg.model.student, "seq": t.seq_length, "micro": t.micro_batch_size,
        "precision": t.precision, "params_dtype": cfg.model.params_dtype,
        "recompute": t.recompute, "steps": steps, "lm_steps": lm_steps, "notes": notes,
        "device": str(st.device), "peak_tflops": peak_flops / 1e12,
        "kd_step_ms": 1e3 * kd_s, "lm_step_ms": 1e3 * lm_s, "kd_overhead": kd_s / lm_s - 1.0,
        "kd_tokens_per_s": kd_tps, "lm_tokens_per_s": lm_tps,
        "kd_mfu": kd_tps * per_gpu * plan.flops["total"] / peak_flops,
        "lm_mfu": lm_tps * per_gpu * plan.flops["student"] / peak_flops,
        "kd_peak_gib": kd_peak, "lm_peak_gib": lm_peak, "plan_peak_gib": plan.peak / GiB,
        "plan_over_measured": None if not kd_peak else plan.peak / GiB / kd_peak,
        "plan_items_gib": {n: b / GiB for n, b, _ in plan.items},
        "grad_dtypes": sorted(grads), "optimizer_state_dtypes": sorted(opt_dtypes),
        "plan_precision": plan.precision, "first_loss": kd_losses[0], "last_loss": kd_losses[-1],
        "finite": all(x == x and abs(x) != float("inf") for x in kd_losses),
    }
