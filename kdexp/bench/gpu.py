"""GPU check: the CUDA-only code paths end to end and the real-shape numbers, in about 10 minutes on one H100/H200.

    python -m kdexp.bench.gpu [--steps 6] [--tokens 2048] [--vocab 151936] [--scale-steps 50] [--seq 4096]
                              [--micro 1] [--recompute none] [--teacher 1.7b] [--student 0.6b] [--keep DIR]
                              [--attention sdpa] [--fused-head both]

1. The KD loss benchmark's configurations (kdexp.bench.losses) at Qwen3's vocabulary (151,936), fp32 and bf16 inputs:
   fwd+bwd time and peak extra memory (torch.cuda.max_memory_allocated) of kdexp, of the plain PyTorch version and,
   when ModelOpt is installed, of ModelOpt's Megatron-plugin losses (dense and renormalised Top-K), with each one's
   per-token difference from the plain version.
2. Two tiny TP=1 distillations of the embedded smoke config through the real CLI (`python -m kdexp.run`), float32
   and bfloat16 parameters, on a fresh cache (the teacher pretraining runs on the GPU too): each must finish with
   finite losses and its checkpoint tensors must have been saved from a CUDA device (no CPU fallback). Then one
   short on-policy distillation (bfloat16, `rollout=on_policy`: the student generates with megatron's KV cache on the
   GPU, the teacher scores, the loss on the generated tokens): the same checks, and its rollout metrics and
   val/onpolicy_reverse_kl finite.
3. A distillation at real shapes (kdexp.bench.gpu_scale): Qwen3-1.7B teacher -> Qwen3-0.6B student, random init,
   bf16 (trainer.precision=bf16 where the schema has it), seq 4096, --scale-steps KD steps through the trainer's own
   setup and step, then LM-only steps: tokens/s, MFU, peak memory of each, the KD overhead over LM-only, and
   kdexp.plan's predicted peak beside torch.cuda.max_memory_allocated.

Parts 2 and 3 run once per --fused-head setting: loss.fused_head=true and =false in turn (`both`, the default: the
fused head against the whole-logits path on the same machine, tiny and at real shapes), or one of auto / true /
false; "distill" and "scale" hold one entry per run, each with its "fused_head". Every part runs with
model.attention=--attention (default sdpa: torch's fused attention kernels; megatron: the
unfused DotProductAttention, for comparison). Sequence parallelism needs TP >= 2 (megatron and kdexp's config refuse
it at TP 1), so this one-GPU check cannot turn it on; what it changed that runs at TP 1 runs here in every model
(kdexp's RMSNorm in place of megatron's local norm; the TP gradient rule of norm weights, a no-op at TP 1).

The last stdout line is one JSON object ({"ok": ..., "device": ..., "loss": [...], "distill": [...], "scale": [...]});
progress goes to stderr. Exit status 0 when every check passed, 1 when one failed, and 1 with a one-line message when
this machine has no CUDA GPU (the module imports on any machine).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from kdexp.bench import parser

LOSS_TOL = {"fp32": 1e-4, "bf16": 1e-3}  # max |kdexp - plain| per token: both compute in fp32 from the same inputs
MODELOPT_TWIN = {"dense": "dense", "topk_renorm": "topk"}  # kdexp config -> ModelOpt loss computing the same value


def _say(msg: str) -> None:
    print(f"[gpu] {msg}", file=sys.stderr, flush=True)


def no_gpu_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return (f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); run this on a machine with an NVIDIA GPU and a CUDA build of torch")


def _saved_devices(run_dir: Path) -> set[str]:
    """The devices the student's weights in the last checkpoint were saved from (torch.load puts them back there)."""
    (latest,) = sorted((run_dir / "checkpoints").glob("step_*/tp0.pt"))[-1:]
    model = torch.load(latest, weights_only=True)["model"]  # tensors and plain values only: nothing runs code
    return {t.device.type for t in model.values() if isinstance(t, torch.Tensor)}


# The on-policy run of part 2: every step after the first on the student's samples (generation with megatron's KV
# cache on the GPU, the teacher scoring them, the loss on the generated tokens through the fused head).
ON_POLICY = ("rollout=on_policy", "rollout.warmup_steps=1", "rollout.max_new_tokens=16")
ON_POLICY_KEYS = ("rollout/kd_loss", "rollout/length", "rollout/entropy", "val/onpolicy_reverse_kl")


def distill(work: Path, dtype: str, steps: int, cache: Path | None = None, attention: str = "sdpa",
            fused_head: str = "auto", on_policy: bool = False) -> dict:
    """One tiny distillation through the CLI; ``on_policy``: the ON_POLICY overrides, and its rollout metrics and
    val/onpolicy_reverse_kl must be finite too."""
    run_dir = work / f"run_{dtype}_fused_{fused_head}{'_on_policy' if on_policy else ''}"
    cmd = [sys.executable, "-m", "kdexp.run", "experiment=smoke", "logger=none", f"model.params_dtype={dtype}",
           f"model.attention={attention}", f"loss.fused_head={fused_head}",
           f"trainer.max_steps={steps}", f"trainer.warmup_steps={min(2, steps)}", f"hydra.run.dir={run_dir}",
           *(ON_POLICY if on_policy else ())]
    env = {**os.environ, "KDEXP_CACHE": str(cache or work / "cache")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    out = {"params_dtype": dtype, "fused_head": fused_head, "on_policy": on_policy, "rc": proc.returncode,
           "run_dir": str(run_dir)}
    summary_file = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_file.is_file():
        out.update(ok=False, error=proc.stderr.strip()[-2000:])
        return out
    summary = json.loads(summary_file.read_text())
    final = summary.get("final", {})
    # an on-policy step logs its KD loss as train/loss and rollout/kd_loss (no train/kd_loss): checked are its own
    checked = ("train/loss", "val/lm_loss", "val/kl_to_teacher", *ON_POLICY_KEYS) if on_policy else \
        ("train/loss", "train/kd_loss", "val/lm_loss", "val/kl_to_teacher")
    keys = (*dict.fromkeys(("train/loss", "train/kd_loss", "val/lm_loss", "val/kl_to_teacher", *checked)),
            "perf/tokens_per_s", "perf/step_ms")
    out.update({k: final.get(k) for k in keys}, status=summary.get("status"), steps=summary.get("steps"))
    out["saved_from"] = sorted(_saved_devices(run_dir))
    finite = all(isinstance(final.get(k), float) and math.isfinite(final[k]) for k in checked)
    out["ok"] = summary.get("status") == "finished" and summary.get("steps") == steps and finite \
        and out["saved_from"] == ["cuda"]
    return out


def loss_bench(tokens: int, vocab: int, repeats: int, device: str = "cuda") -> list[dict]:
    from kdexp.bench.losses import CONFIGS, DTYPES, measure, modelopt_kd, plain_kd
    from kdexp.losses import logits_kd_loss

    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    t32 = torch.randn(tokens, vocab, generator=g) * 5.0  # the benchmark's peaked teacher (see kdexp.bench.losses)
    s32 = t32 + torch.randn(tokens, vocab, generator=g) * 2.0
    rows = []
    for dname, dtype in DTYPES.items():
        s0, t = s32.to(device=device, dtype=dtype), t32.to(device=device, dtype=dtype)
        for cname, kw in CONFIGS.items():
            ref, ref_times, ref_extra = measure(lambda s, t, kw=kw: plain_kd(s, t, **kw), s0, t, repeats)
            loss, times, extra = measure(lambda s, t, kw=kw: logits_kd_loss(s, t, **kw), s0, t, repeats)
            diff = (loss.float() - ref.float()).abs().max().item()
            row = {"config": cname, "dtype": dname, "kdexp_ms": 1e3 * statistics.median(times),
                   "plain_ms": 1e3 * statistics.median(ref_times), "kdexp_extra_mib": extra / 2**20,
                   "plain_extra_mib": ref_extra / 2**20, "max_abs_diff": diff}
            row["ok"] = math.isfinite(diff) and diff <= LOSS_TOL[dname] and bool(torch.isfinite(loss).all())
            if cname in MODELOPT_TWIN:  # the same loss in ModelOpt, when it is installed (timed, not judged)
                mo = modelopt_kd(MODELOPT_TWIN[cname], kw.get("top_k"))
                row["modelopt_ms"] = row["modelopt_max_abs_diff"] = row["modelopt_extra_mib"] = None
                if mo is not None:
                    mo_loss, mo_times, mo_extra = measure(mo, s0, t, repeats)
                    row.update(modelopt_ms=1e3 * statistics.median(mo_times), modelopt_extra_mib=mo_extra / 2**20,
                               modelopt_max_abs_diff=(mo_loss.float() - ref.float()).abs().max().item())
            rows.append(row)
            _say(f"loss {cname:<12} {dname}: kdexp {row['kdexp_ms']:.2f} ms / {row['kdexp_extra_mib']:.0f} MiB, "
                 f"plain {row['plain_ms']:.2f} ms / {row['plain_extra_mib']:.0f} MiB, |diff| {diff:.1e}")
        del s0, t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def scale(args, fused_head: str) -> dict:
    """Part 3 in a child process (a clean CUDA context, its own process group), its JSON line back."""
    cmd = [sys.executable, "-c", "import json, sys; from kdexp.bench import gpu_scale; "
           "print(json.dumps(gpu_scale.run(*sys.argv[1:3], steps=int(sys.argv[3]), lm_steps=int(sys.argv[4]), "
           "seq=int(sys.argv[5]), micro=int(sys.argv[6]), recompute=sys.argv[7], extra=tuple(sys.argv[8:]))))",
           args.teacher, args.student, str(args.scale_steps), str(args.lm_steps), str(args.seq), str(args.micro),
           args.recompute, f"model.attention={args.attention}", f"loss.fused_head={fused_head}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"ok": False, "fused_head": fused_head, "rc": proc.returncode, "error": proc.stderr.strip()[-2000:]}
    out = {"fused_head": fused_head, **json.loads(lines[-1])}
    out["ok"] = bool(out["finite"]) and out["kd_peak_gib"] is not None
    return out


def main(argv=None) -> int:
    ap = parser(__spec__.name, __doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="distillation steps per run")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the loss benchmark")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary of the loss benchmark")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of the loss benchmark")
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs in this directory; unset: a temp dir")
    ap.add_argument("--scale-steps", type=int, default=50, help="KD steps at real shapes (0: skip that part)")
    ap.add_argument("--lm-steps", type=int, default=10, help="LM-only steps at real shapes")
    ap.add_argument("--seq", type=int, default=4096, help="trainer.seq_length at real shapes")
    ap.add_argument("--micro", type=int, default=1, help="trainer.micro_batch_size at real shapes")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                    help="trainer.recompute at real shapes")
    ap.add_argument("--teacher", default="1.7b", help="model.teacher at real shapes (a Qwen3 size)")
    ap.add_argument("--student", default="0.6b", help="model.student at real shapes (a Qwen3 size)")
    ap.add_argument("--attention", default="sdpa", choices=("sdpa", "megatron"), help="model.attention of every part")
    ap.add_argument("--fused-head", default="both", choices=("both", "auto", "true", "false"),
                    help="loss.fused_head of parts 2 and 3 (both: true, then false)")
    args = ap.parse_args(argv)
    if min(args.steps, args.tokens, args.vocab, args.repeats, args.seq, args.micro, args.lm_steps) < 1 or \
            args.scale_steps < 0:
        ap.error("--steps, --tokens, --vocab, --repeats, --seq, --micro and --lm-steps must be >= 1, "
                 "--scale-steps >= 0")
    reason = no_gpu_reason()
    if reason is not None:
        print(f"kdexp.bench.gpu: {reason}", file=sys.stderr)
        return 1
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
              "attention": args.attention}
    settings = ("true", "false") if args.fused_head == "both" else (args.fused_head,)
    _say(f"loss benchmark, {args.tokens} tokens x vocab {args.vocab} ...")
    result["loss"] = loss_bench(args.tokens, args.vocab, args.repeats)
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="kdexp-gpu-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result["distill"] = []
        for fused in settings:
            for dtype in ("float32", "bfloat16"):
                _say(f"distill {args.steps} steps, params {dtype}, loss.fused_head={fused} ...")
                result["distill"].append(distill(work, dtype, args.steps, cache=work / "cache",
                                                 attention=args.attention, fused_head=fused))
                _say(f"distill {dtype}: {json.dumps(result['distill'][-1])}")
        _say(f"on-policy distill {args.steps} steps, params bfloat16, loss.fused_head={settings[0]} ...")
        result["distill"].append(distill(work, "bfloat16", args.steps, cache=work / "cache", attention=args.attention,
                                         fused_head=settings[0], on_policy=True))
        _say(f"on-policy distill: {json.dumps(result['distill'][-1])}")
    result["scale"] = []
    for fused in settings if args.scale_steps else ():
        _say(f"{args.teacher} -> {args.student}, seq {args.seq}, {args.scale_steps} KD + {args.lm_steps} LM steps, "
             f"loss.fused_head={fused} ...")
        result["scale"].append(scale(args, fused))
        _say(f"scale: {json.dumps(result['scale'][-1])}")
    result["ok"] = all(r["ok"] for r in result["distill"] + result["loss"] + result["scale"])
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
