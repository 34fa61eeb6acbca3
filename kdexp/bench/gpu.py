"""GPU check: the CUDA-only code paths end to end, in a minute, with one JSON line to read.

    python -m kdexp.bench.gpu [--steps 6] [--tokens 2048] [--vocab 151936] [--keep DIR]

1. Two tiny TP=1 distillations of the embedded smoke config through the real CLI (`python -m kdexp.run`), one with
   float32 and one with bfloat16 parameters, on a fresh cache (so the teacher pretraining runs on the GPU too): each
   must finish, with finite losses, and its checkpoint tensors must have been saved from a CUDA device (the proof the
   run did not fall back to the CPU).
2. The KD loss benchmark's configurations (kdexp.bench.losses) on the GPU, fp32 and bf16 inputs: fwd+bwd time, peak
   extra memory (torch.cuda.max_memory_allocated) and the per-token difference from the plain PyTorch version.

The last stdout line is one JSON object ({"ok": ..., "device": ..., "distill": [...], "loss": [...]}); progress goes
to stderr. Exit status 0 when every check passed, 1 when one failed, and 1 with a one-line message when this machine
has no CUDA GPU (the module imports on any machine).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

LOSS_TOL = {"fp32": 1e-4, "bf16": 1e-3}  # max |kdexp - plain| per token: both compute in fp32 from the same inputs


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
    model = torch.load(latest, weights_only=False)["model"]
    return {t.device.type for t in model.values() if isinstance(t, torch.Tensor)}


def distill(work: Path, dtype: str, steps: int, cache: Path | None = None) -> dict:
    run_dir = work / f"run_{dtype}"
    cmd = [sys.executable, "-m", "kdexp.run", "experiment=smoke", "logger=none", f"model.params_dtype={dtype}",
           f"trainer.max_steps={steps}", f"trainer.warmup_steps={min(2, steps)}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "KDEXP_CACHE": str(cache or work / "cache")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    out = {"params_dtype": dtype, "rc": proc.returncode, "run_dir": str(run_dir)}
    summary_file = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_file.is_file():
        out.update(ok=False, error=proc.stderr.strip()[-2000:])
        return out
    summary = json.loads(summary_file.read_text())
    final = summary.get("final", {})
    keys = ("train/loss", "train/kd_loss", "val/lm_loss", "val/kl_to_teacher", "perf/tokens_per_s", "perf/step_ms")
    out.update({k: final.get(k) for k in keys}, status=summary.get("status"), steps=summary.get("steps"))
    out["saved_from"] = sorted(_saved_devices(run_dir))
    finite = all(isinstance(final.get(k), float) and math.isfinite(final[k]) for k in keys[:4])
    out["ok"] = summary.get("status") == "finished" and summary.get("steps") == steps and finite \
        and out["saved_from"] == ["cuda"]
    return out


def loss_bench(tokens: int, vocab: int, repeats: int, device: str = "cuda") -> list[dict]:
    from kdexp.bench.losses import CONFIGS, DTYPES, measure, plain_kd
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
            rows.append(row)
            _say(f"loss {cname:<12} {dname}: kdexp {row['kdexp_ms']:.2f} ms / {row['kdexp_extra_mib']:.0f} MiB, "
                 f"plain {row['plain_ms']:.2f} ms / {row['plain_extra_mib']:.0f} MiB, |diff| {diff:.1e}")
        del s0, t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="distillation steps per run")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the loss benchmark")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary of the loss benchmark")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs in this directory (default: a temp dir)")
    args = ap.parse_args(argv)
    if min(args.steps, args.tokens, args.vocab, args.repeats) < 1:
        ap.error("--steps, --tokens, --vocab and --repeats must be >= 1")
    reason = no_gpu_reason()
    if reason is not None:
        print(f"kdexp.bench.gpu: {reason}", file=sys.stderr)
        return 1
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}
    with tempfile.TemporaryDirectory(prefix="kdexp-gpu-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result["distill"] = []
        for dtype in ("float32", "bfloat16"):
            _say(f"distill {args.steps} steps, params {dtype} ...")
            result["distill"].append(distill(work, dtype, args.steps))
            _say(f"distill {dtype}: {json.dumps(result['distill'][-1])}")
    result["loss"] = loss_bench(args.tokens, args.vocab, args.repeats)
    result["ok"] = all(r["ok"] for r in result["distill"] + result["loss"])
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
