"""kdexp.plan: what one run needs per GPU before it launches (memory item by item, FLOPs, an MFU-based tokens/s).

    python -m kdexp.plan [--gpus N] [--mfu 0.35] [--json] [--max-micro] [overrides ...]

``make_plan(cfg)`` reads the composed config (model shapes, trainer.micro_batch_size / seq_length /
global_batch_size / precision / recompute, parallel.tensor / sequence, the loss and balancer) and needs no weights,
no data and no GPU. ``refuse_if_too_big(cfg)`` is kdexp.run's check against ``trainer.gpu_memory_gb``. The formulas
and their references are in kdexp.plan.sizing.

Memory is the peak of torch's allocator (what ``torch.cuda.max_memory_allocated`` reports) at the start of the
student's backward pass: teacher and student weights, the student's gradients and optimizer state (allocated for the
whole run), all layers' saved activations of one micro-batch, the logit-sized buffers of the LM and KD losses. A
fixed reserve (CUDA context, cuBLAS workspace, NCCL buffers, allocator fragmentation) is added before comparing with
the GPU's memory. Precision is kdexp.config.precision's rule, the one the trainer builds by: fp32 keeps fp32 weights,
gradients and Adam moments; bf16 weights (trainer.precision=bf16 or model.params_dtype=bfloat16) come with fp32
gradients, fp32 master weights and Adam moments (12 bytes per parameter, split over DP with a distributed
optimizer). The teacher never has gradients or optimizer state. With teacher=cached the step reads the batch's
decoded cache record (kdexp.teacher.format.Layout.decoded_bytes_per_token) instead of running the teacher: no teacher
logits, forward transient or FLOPs in the step; its weights stay for evaluation.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from kdexp.plan import sizing

GiB = float(2**30)
RESERVE_GIB = 1.0  # CUDA context (~0.5 GiB), cuBLAS workspace, NCCL buffers
FRAGMENTATION = 0.05  # of the allocated peak: the caching allocator's reserved-but-unallocated blocks
DEFAULT_MFU = 0.35


@dataclass
class Plan:
    teacher: str
    student: str
    gpus: int
    tp: int
    dp: int
    precision: str
    micro_batch: int
    seq: int
    global_batch: int
    accumulation: int
    recompute: str
    sequence_parallel: bool
    distributed_optimizer: bool
    peak_tflops: float  # trainer.gpu_peak_tflops
    gpu_memory_gb: Optional[float]  # trainer.gpu_memory_gb
    attention: str  # model.attention
    items: list = field(default_factory=list)  # (name, bytes, note), the allocated peak's parts
    peak: float = 0.0
    reserve: float = 0.0
    flops: dict = field(default_factory=dict)  # per token
    mfu: float = DEFAULT_MFU
    # generation's phase (rollout=on_policy's steps and val/onpolicy_reverse_kl's eval in every run): name -> bytes
    rollout: dict = field(default_factory=dict)

    @property
    def needs(self) -> float:
        return self.peak + self.reserve

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.mfu * self.peak_tflops * 1e12 / self.flops["total"]

    def biggest(self, n: int = 3) -> list:
        return sorted(self.items, key=lambda it: -it[1])[:n]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["items"] = [{"name": n, "bytes": b, "note": note} for n, b, note in self.items]
        d.update(needs=self.needs, tokens_per_s_per_gpu=self.tokens_per_s_per_gpu,
                 tokens_per_s=self.tokens_per_s_per_gpu * self.gpus,
                 step_s=self.global_batch * self.seq / (self.tokens_per_s_per_gpu * self.gpus))
        return d


def model_spec(cfg, role: str):
    """The role's Qwen3Spec: from its checkpoint's config.json, else QWEN3_SIZES (tiny presets with the vocabulary
    the run's tokenizer will have: data.vocab_size for the trained BPE)."""
    from kdexp import models

    path = getattr(cfg.model, f"{role}_path")
    if path is not None:
        return models.spec_from_hf(models.read_config(os.path.expanduser(path)))
    name = models.size_key(getattr(cfg.model, role))
    if name.startswith("tiny") and cfg.data.name == "stdlib" and cfg.data.tokenizer is None:
        return models.get_spec(name, vocab_size=cfg.data.vocab_size)
    return models.get_spec(name)


def _label(cfg, role: str, spec) -> str:
    """The role's name in the plan: its size, or for a checkpoint of another shape its directory and parameters."""
    from kdexp import models

    path = getattr(cfg.model, f"{role}_path")
    return models.label(spec, path) if path is not None else models.size_key(getattr(cfg.model, role))


def _formats(cfg):
    """The run's numeric formats on GPUs (kdexp.config.precision: the rule the trainer builds by)."""
    from kdexp.config import precision

    return precision.of(cfg, cuda=True)


def _chunk_rows(tokens: int, local_vocab: int) -> int:
    """The KD loss's chunk height, from its own rule (kdexp.losses.chunking.logit_rows)."""
    import torch

    from kdexp.losses.chunking import logit_rows

    return logit_rows(tokens, local_vocab, torch.float32)


def _cache_layout(cfg, vocab: int, teacher_hidden: int, dtype: str):
    """The offline teacher cache's layout for teacher=cached (its record type, K_max, draws or hidden size), else
    None; the sample count does not matter here."""
    if cfg.teacher.name != "cached":
        return None
    from kdexp.teacher import format as fmt

    return fmt.Layout.from_config(cfg, vocab, samples=0, hidden_size=teacher_hidden, hidden_dtype=dtype)


def make_plan(cfg: Any, *, gpus: Optional[int] = None, mfu: float = DEFAULT_MFU) -> Plan:
    """The plan of a composed config on `gpus` GPUs (default: one DP replica, parallel.tensor GPUs)."""
    from kdexp.config import precision
    from kdexp.config.checks import accumulation_steps
    from kdexp.losses import BalancerOptions, KDLossOptions
    import torch

    from kdexp.losses.logits import TOP_P_INITIAL_K, holds_gradient
    from kdexp.losses.options import SampledKDOptions, cuts
    from kdexp.models import check_tp

    t, par = cfg.trainer, cfg.parallel
    tp = int(par.tensor)
    gpus = tp if gpus is None else int(gpus)
    if gpus < 1 or gpus % tp:
        raise ValueError(f"--gpus={gpus} is invalid: must be a positive multiple of parallel.tensor={tp}")
    dp = gpus // tp
    teacher, student = model_spec(cfg, "teacher"), model_spec(cfg, "student")
    check_tp(teacher, tp)
    check_tp(student, tp)
    recompute, attention = t.recompute, cfg.model.attention
    sp = bool(par.sequence) and tp > 1
    fm = _formats(cfg)
    e, grad_b, opt_b = fm.weight_bytes, fm.grad_bytes, fm.optimizer_bytes
    distopt = fm.sharded  # megatron's ZeRO-1: optimizer state split over DP
    micro, seq = int(t.micro_batch_size), int(t.seq_length)
    accumulation = accumulation_steps(t.global_batch_size, micro, dp)  # the trainer's own rule
    gb = accumulation * micro * dp
    tokens = micro * seq
    p = Plan(teacher=_label(cfg, "teacher", teacher), student=_label(cfg, "student", student), gpus=gpus, tp=tp, dp=dp, precision=fm.label,
             micro_batch=micro, seq=seq, global_batch=gb, accumulation=gb // (micro * dp), recompute=recompute,
             sequence_parallel=sp, distributed_optimizer=distopt, mfu=mfu, peak_tflops=float(t.gpu_peak_tflops),
             gpu_memory_gb=t.gpu_memory_gb, attention=attention)

    n_t, n_s = sizing.params_per_rank(teacher, tp), sizing.params_per_rank(student, tp)
    opt_share = dp if distopt else 1
    dt = precision.SHORT[fm.weights]
    p.items += [
        ("teacher weights", n_t * e, f"{n_t / 1e6:,.1f} M params per TP rank, {dt}, no grads"),
        ("student weights", n_s * e, f"{n_s / 1e6:,.1f} M params per TP rank, {dt}"),
        ("student gradients", n_s * grad_b, precision.SHORT[fm.grads]
         + (" (the bf16 backward's moved into the masters' as it runs)" if fm.master and not fm.megatron else
            " (megatron's contiguous DDP buffers)" if fm.megatron else "")),
        ("optimizer state", n_s * opt_b / opt_share,
         (f"{precision.SHORT[fm.master]} master + " if fm.master else "")
         + f"Adam m, v ({precision.SHORT[fm.moments]})"
         + (f", split over DP={dp}" if distopt else ", not split (no distributed optimizer)")),
    ]
    layer = sizing.layer_bytes(student, tokens, seq, e, sizing.Parallel(tp, sp), recompute, attention)
    acts = student.num_layers * layer["kept"] + sizing.outside_layers_bytes(student, tokens, seq, e,
                                                                              sizing.Parallel(tp, sp), attention)
    p.items.append(("activations", acts, f"{student.num_layers} layers x {layer['kept'] / 2**20:,.1f} MiB, "
                    f"recompute {recompute}{', seq. parallel' if sp else ''}, {attention} attention "
                    "(Korthikanti et al. 2022)"))
    if attention == "megatron":
        p.items.append(("attention score buffer", sizing.attention_buffer_bytes((teacher, student), micro, seq, e, tp,
                                                                                attention),
                        "megatron's global buffer [b x heads/TP, s, s], kept"))
    if layer["working"]:
        p.items.append(("recompute working set", layer["working"], "one layer rebuilt during its backward"))
    vocab = student.vocab_size // tp
    # An LM loss fused into the KD loss (the step's rule: kdexp.losses.KDLossOptions.fuses_lm) saves O(K) per token
    # more and has no fp32 copy or gradient of its own.
    fused = KDLossOptions.from_config(cfg.loss).fuses_lm(sampled=SampledKDOptions.from_config(cfg.loss).enabled)
    needs_lm = BalancerOptions.from_config(cfg.balancer).build().needs_lm_loss and not fused
    top_k = cfg.loss.top_k
    top_p = cfg.loss.top_p if cuts(cfg.loss.top_p) else None  # 1.0 cuts nothing: the loss runs without a cut
    kd_saved = sizing.kd_saved_per_token(top_k, top_p, TOP_P_INITIAL_K, fused_lm=fused)
    # teacher=cached: no teacher forward in the train step (a hidden store still forms the teacher's logits)
    layout = _cache_layout(cfg, student.vocab_size, teacher.hidden_size, "float32" if e == 4 else "bfloat16")
    head_only = layout is not None and layout.record == "hidden"
    # what the step holds of the teacher's side: a record decoded from the cache, or (online, or a hidden store: its
    # hidden states formed into logits by the teacher's head) the teacher's logits / final hidden states
    record = None if layout is None or head_only else layout.decoded_bytes_per_token()
    logits_dtype = torch.float32 if e == 4 else torch.bfloat16
    logits = sizing.logits_bytes(tokens, vocab, e, needs_lm=needs_lm, kd_saved=kd_saved,
                                 chunk_rows=_chunk_rows(tokens, vocab),
                                 kept=0 if top_k is None and top_p is None else (top_k or TOP_P_INITIAL_K),
                                 cut=top_p is not None,
                                 cache_record=record,
                                 held=top_k is not None and holds_gradient(top_p, tp, logits_dtype))
    shape = f"[{tokens}, {vocab}]"
    from kdexp.losses.chunking import head_rows
    from kdexp.losses.head import uses_fused_head

    if uses_fused_head(cfg.loss.fused_head, tokens, vocab):  # the logits exist one chunk of tokens at a time
        rows = head_rows(tokens, vocab, logits_dtype)
        chunk = sizing.logits_bytes(rows, vocab, e, needs_lm=needs_lm, kd_saved=kd_saved,
                                    chunk_rows=min(rows, _chunk_rows(rows, vocab)),
                                    kept=0 if top_k is None and top_p is None else (top_k or TOP_P_INITIAL_K),
                                    cut=top_p is not None, held=top_k is not None and holds_gradient(top_p, tp,
                                                                                                   logits_dtype))
        if layout is not None and not head_only:  # a cache record's rows are views of the batch's record
            chunk.pop("teacher logits")
        logits = sizing.fused_head_bytes(tokens, vocab, student.hidden_size, teacher.hidden_size, e,
                                         chunk_rows=rows, chunk=chunk,
                                         cache_record=record)
        notes = {"teacher hidden states": f"[{tokens}, {teacher.hidden_size}] {dt}",
                 "teacher cache record": None if layout is None else
                 f"{layout.describe()} per token, as read (fp32 values, int64 ids); teacher weights kept for eval",
                 "head hidden states": f"[{tokens}, {student.hidden_size}] {dt}",
                 "head gradients": f"hidden states {dt} + output weight [{vocab}, {student.hidden_size}] fp32",
                 "head chunk working set": f"{rows} tokens: logits, gradients, loss buffers"}
        p.items += [(k, v, notes[k]) for k, v in logits.items() if v]
    else:
        notes = {"teacher logits": f"{shape} {dt}", "student logits": f"{shape} {dt}",
                 "teacher cache record": None if layout is None else
                 f"{layout.describe()} per token, as read (fp32 values, int64 ids); teacher weights kept for eval",
                 "LM loss fp32 softmax": f"{shape} fp32", "KD loss saved values": f"top_k={top_k} top_p={top_p}",
                 "logit gradients": "KD" + (" + LM" if needs_lm else " (LM fused)" if fused else ""), "KD loss chunk buffer": "fp32, one chunk of tokens"}
        p.items += [(k, v, notes[k]) for k, v in logits.items() if v]
    # The teacher's no-grad forward runs before the student's: its one-layer transient (megatron's attention: scores,
    # softmax and copy; sdpa's kernels hold no [s, s] tensor; the MLP's fc1 output and products) counts only if larger
    # than the student's logit and activation parts.
    a_t = teacher.num_heads // tp
    scores_t = (4 + 4 + (2 if e == 2 else 0)) * a_t * seq if attention == "megatron" else 0
    teacher_layer = tokens * max(scores_t, 5 * e * teacher.intermediate_size / tp)
    static = ("teacher weights", "student weights", "student gradients", "optimizer state", "attention score buffer")
    student_phase = sum(v for k, v, _ in p.items if k not in static)
    # (what the teacher's side keeps: its logits, or with the fused head its final hidden states)
    teacher_kept = [it for it in p.items if it[0] in ("teacher logits", "teacher hidden states")]
    teacher_phase = 0 if layout is not None else sum(v for _, v, _ in teacher_kept) + teacher_layer
    r = cfg.rollout
    if not sp:  # a sequence-parallel run generates nothing (no rollouts, no val/onpolicy_reverse_kl)
        p.rollout = sizing.rollout_bytes(student, micro, int(r.prompt_tokens), int(r.max_new_tokens), e, tp,
                                         attention)
    rollout_phase = sum(p.rollout.values())
    if teacher_phase > student_phase and teacher_phase >= rollout_phase:
        p.items = [it for it in p.items if it[0] in static] + teacher_kept
        p.items += [("teacher forward layer", teacher_layer, "no-grad transient of one layer: the peak")]
    elif rollout_phase > max(student_phase, teacher_phase):  # generation before the step is the peak
        p.items = [it for it in p.items if it[0] in static]
        p.items += [(f"rollout {k}", v, "generation (no grad), before the step: the peak") for k, v in p.rollout.items()]
    p.peak = sum(v for _, v, _ in p.items)
    p.reserve = RESERVE_GIB * GiB + FRAGMENTATION * p.peak

    fs = sizing.flops_per_token(student, seq, backward=True)
    # cached: the teacher's forward is a one-off build, not part of the step; a hidden store's step runs the teacher's
    # output layer (2 H V per token)
    ft = 0.0 if layout is not None else sizing.flops_per_token(teacher, seq, backward=False)
    if head_only:
        ft = 2.0 * teacher.hidden_size * student.vocab_size
    p.flops = {"student": fs, "teacher": ft, "total": fs + ft,
               "recompute": sizing.recompute_flops_per_token(student, seq, recompute),
               "student_6n": 6 * sum(sizing.matmul_params(student)), "teacher_2n": 2 * sum(sizing.matmul_params(teacher))}
    return p


def flops_per_token(cfg: Any) -> dict:
    """Model FLOPs per trained token of a composed config, by make_plan's formulas (kdexp.plan.sizing): the student's
    training step (forward + backward) and the teacher's forward, whether the step runs it (online) or a cache build
    ran it once (cached). What kdexp.track.cost records for every run."""
    seq = int(cfg.trainer.seq_length)
    return {"student": sizing.flops_per_token(model_spec(cfg, "student"), seq, backward=True),
            "teacher_forward": sizing.flops_per_token(model_spec(cfg, "teacher"), seq, backward=False)}


def _gib(x: float, unit: float = GiB) -> str:
    return f"{x / unit:,.2f}"


def _size(x: float) -> str:
    return f"{x / GiB:,.2f} GiB" if x >= GiB / 10 else f"{x / 2**20:,.1f} MiB"


def format_table(p: Plan) -> str:
    f = p.flops
    w = 28
    unit, uname = (GiB, "GiB") if p.peak >= GiB else (2.0**20, "MiB")  # tiny runs read in MiB
    head = (f"kdexp plan: teacher {p.teacher} -> student {p.student} on {p.gpus} GPU(s) = TP {p.tp} x DP {p.dp}; "
            f"{p.precision}; micro-batch {p.micro_batch} x seq {p.seq}; global batch {p.global_batch} "
            f"({p.accumulation} micro-batch(es) per DP rank and step)")
    lines = [head, "", f"{'per GPU':<{w}} {uname:>9}  note", "-" * 100]
    lines += [f"{name:<{w}} {_gib(b, unit):>9}  {note}" for name, b, note in p.items]
    lines += ["-" * 100, f"{'peak allocated':<{w}} {_gib(p.peak, unit):>9}  torch.cuda.max_memory_allocated",
              f"{'reserve':<{w}} {_gib(p.reserve, unit):>9}  CUDA context, NCCL, fragmentation "
              f"({RESERVE_GIB:g} GiB + {FRAGMENTATION:.0%})"]
    verdict = "" if p.gpu_memory_gb is None else (
        f"  fits trainer.gpu_memory_gb={p.gpu_memory_gb:g}" if p.needs <= p.gpu_memory_gb * GiB else
        f"  DOES NOT FIT trainer.gpu_memory_gb={p.gpu_memory_gb:g}")
    lines += [f"{'needs':<{w}} {_gib(p.needs, unit):>9}{verdict}", ""]
    if p.rollout:
        lines += [f"{'generation (no grad)':<{w}} {_gib(sum(p.rollout.values()), unit):>9}  "
                  + ", ".join(f"{k} {_gib(v, unit)} {uname}" for k, v in p.rollout.items())
                  + f" (micro-batch {p.micro_batch}; rollout=on_policy's steps, val/onpolicy_reverse_kl's eval)", ""]
    tps = p.tokens_per_s_per_gpu
    lines += [
        f"{'FLOPs per token':<{w}} {f['total'] / 1e9:>9,.2f} G  student fwd+bwd {f['student'] / 1e9:,.2f} G "
        f"(6N {f['student_6n'] / 1e9:,.2f} G + attention), teacher fwd {f['teacher'] / 1e9:,.2f} G "
        f"(2N {f['teacher_2n'] / 1e9:,.2f} G + attention)"
        + ("; 0 in the step: teacher=cached" if not f["teacher"] else "")
        + (f"; recompute adds {f['recompute'] / 1e9:,.2f} G (not model FLOPs)" if f["recompute"] else ""),
        f"{'tokens/s at MFU':<{w}} {tps:>9,.0f}  per GPU; {tps * p.gpus:,.0f} on {p.gpus} GPU(s) "
        f"(MFU {p.mfu:.0%} of {p.peak_tflops:g} TFLOP/s); step of {p.global_batch * p.seq:,} tokens "
        f"{p.global_batch * p.seq / (tps * p.gpus):,.2f} s",
    ]
    return "\n".join(lines)


def largest_micro_batch(cfg: Any, *, gpus: Optional[int] = None, limit_gib: float, most: int = 1 << 16):
    """(m, plan of m, plan of m + 1): the largest trainer.micro_batch_size whose plan needs at most `limit_gib` GiB per
    GPU, the other keys of `cfg` as they are (global batch: micro x DP, which no memory item depends on); m = 0 when
    micro-batch 1 does not fit. The need grows with the micro-batch, so it is found by doubling and bisection."""
    from omegaconf import OmegaConf

    probe = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    probe.trainer.global_batch_size = None
    plans: dict[int, Plan] = {}

    def plan(m: int) -> Plan:
        if m not in plans:
            probe.trainer.micro_batch_size = m
            plans[m] = make_plan(probe, gpus=gpus)
        return plans[m]

    def fits(m: int) -> bool:
        return plan(m).needs <= limit_gib * GiB

    lo, hi = 0, 1  # fits(lo) (0: vacuously), hi: the first probe that does not fit
    while hi <= most and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, most + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, plan(lo) if lo else None, plan(lo + 1) if lo < most else None


def refuse_if_too_big(cfg: Any) -> None:
    """kdexp.run's check: a ValueError naming trainer.gpu_memory_gb when the plan's need exceeds it (no-op unset)."""
    limit = cfg.trainer.gpu_memory_gb
    if limit is None:
        return
    from kdexp.distributed.launch import launch_env
    from kdexp.rules import fail

    tp = int(cfg.parallel.tensor)
    world = launch_env().world_size
    p = make_plan(cfg, gpus=world if world % tp == 0 and world >= tp else tp)
    if p.needs > limit * GiB:
        big = ", ".join(f"{n} {_size(b)}" for n, b, _ in p.biggest())
        fail("trainer.gpu_memory_gb", limit,
             f"the plan needs {_size(p.needs)} per GPU ({_size(p.peak)} allocated at the peak + {_size(p.reserve)} "
             f"reserve); biggest: {big}. Lower trainer.micro_batch_size, raise parallel.tensor, set "
             "trainer.recompute=selective or full, or parallel.sequence=true; `python -m kdexp.plan` with the same "
             "overrides prints the table")
