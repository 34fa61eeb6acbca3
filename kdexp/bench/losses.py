"""Benchmark of the logit KD loss: kdexp vs a plain PyTorch autograd implementation vs ModelOpt (if importable).

    python -m kdexp.bench.losses [--tokens 512] [--vocab 151936] [--dtypes fp32,bf16] [--repeats 3] [--device cpu]
                                 [--configs dense,topk,topk_topp,topp,topk_renorm] [--threads N]

For each configuration and dtype it times forward+backward (median of --repeats after one warm-up) and measures the
peak extra memory: the peak of live tensor bytes during forward+backward, above the inputs, minus the student
gradient itself. On CUDA that is torch.cuda.max_memory_allocated; on CPU a TorchDispatchMode that adds up the
storages the ops create and drops them when they are freed (allocations inside one kernel are not seen). Times and
ratios come from one run; on a shared CPU they are noisy, so the table also prints the spread of the repeats.

Inputs are synthetic: teacher logits ~ N(0, 1) * --teacher-scale (5: a peaked distribution whose 0.95 nucleus holds
tens to hundreds of tokens, like an LM's), student = teacher + N(0, 1) * 2.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kdexp.losses import logits_kd_loss
from kdexp.bench import parser

CONFIGS = {
    "dense": dict(),
    "topk": dict(top_k=1024, ghost_token=True),
    "topk_topp": dict(top_k=1024, top_p=0.95, ghost_token=True),
    "topp": dict(top_p=0.95, ghost_token=True),
    "topk_renorm": dict(top_k=1024, normalization="renormalize", ghost_token=False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class StorageTimeline(TorchDispatchMode):
    """Allocation (+bytes) and free (-bytes) events of the tensor storages ops create while the mode is active."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (serial, signed bytes)
        self.live: dict[int, tuple[int, int]] = {}  # data_ptr -> (serial, bytes)
        self.serial = 0

    def _freed(self, ptr: int, serial: int):
        cur = self.live.get(ptr)
        if cur is not None and cur[0] == serial:
            del self.live[ptr]
            self.events.append((serial, -cur[1]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in inputs or ptr in self.live or st.nbytes() == 0:
                continue  # in place, a view, or out=: no new storage
            self.serial += 1
            self.live[ptr] = (self.serial, st.nbytes())
            self.events.append((self.serial, st.nbytes()))
            weakref.finalize(st, self._freed, ptr, self.serial)
        return out

    def peak_excluding(self, exclude: list[torch.Tensor]) -> int:
        """Peak live bytes over the timeline, leaving out the storages of `exclude` (still alive) at every time."""
        skip = {self.live[t.untyped_storage().data_ptr()][0] for t in exclude
                if t is not None and t.untyped_storage().data_ptr() in self.live}
        cur = peak = 0
        for serial, nbytes in self.events:
            if serial not in skip:
                cur += nbytes
                peak = max(peak, cur)
        return peak


class PeakTensorMemory(StorageTimeline):
    """Peak bytes of tensor storages created while the mode is active (CPU or any device)."""

    @property
    def peak(self) -> int:
        return self.peak_excluding([])


def plain_kd(s, t, *, temperature=1.0, top_k=None, top_p=None, min_k=1, ghost_token=True, normalization="full"):
    """The obvious autograd version: log_softmax of both, top-k (or sort), gather, KL, ghost via log(-expm1(.))."""
    ls = F.log_softmax(s.float() / temperature, -1)
    lt = F.log_softmax(t.float() / temperature, -1)
    if top_k is None and top_p is None:
        return (lt.exp() * (lt - ls)).sum(-1)
    # ties: the lower vocabulary id first (kdexp's rule; a stable descending sort), so bf16's many equal values
    # select the same entries
    a, idx = lt.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        a, idx = a[..., :top_k], idx[..., :top_k]
    b = ls.gather(-1, idx)
    keep = torch.ones_like(a, dtype=torch.bool)
    if top_p is not None:
        p = a.exp()
        keep = p.cumsum(-1) - p < top_p
        keep[..., :min_k] = True
    a = a.masked_fill(~keep, -math.inf)
    b = b.masked_fill(~keep, -math.inf)
    if normalization == "renormalize":
        a, b = a.log_softmax(-1), b.log_softmax(-1)
    kl = torch.where(keep, a.exp() * (a - b), torch.zeros_like(a)).sum(-1)
    if ghost_token and normalization == "full":
        ra = torch.log(-torch.expm1(torch.logsumexp(a, -1).clamp(max=-1e-12)))
        rb = torch.log(-torch.expm1(torch.logsumexp(b, -1).clamp(max=-1e-12)))
        kl = kl + ra.exp() * (ra - rb)
    return kl


def modelopt_kd(kind: str, top_k: int | None):
    """ModelOpt's Megatron-plugin loss as a callable (s, t) -> per-token loss, or None if not importable."""
    try:
        from modelopt.torch.distill.plugins import megatron as mo  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - optional dependency; any import failure means "not installed"
        return None
    cfg = SimpleNamespace(tensor_model_parallel_size=1, sequence_parallel=False)  # what the losses read at TP=1
    loss = mo.LogitsKLLoss(cfg) if kind == "dense" else mo.TopKLogitsKLLoss(cfg, top_k=top_k)
    return lambda s, t: loss(s.unsqueeze(1), t.unsqueeze(1))[0]  # [s, b=1, V] -> ([b, s], ...)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(fn, s0, t):
    s = s0.detach().requires_grad_(True)
    loss = fn(s, t)
    loss.sum().backward()
    return loss.detach(), s.grad


def measure(fn, s0, t, repeats: int):
    device = s0.device
    loss, grad = _fwd_bwd(fn, s0, t)  # warm-up
    del grad
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        _, g = _fwd_bwd(fn, s0, t)
        _sync(device)
        times.append(time.perf_counter() - t0)
        del g
    grad_bytes = s0.numel() * s0.element_size()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _, g = _fwd_bwd(fn, s0, t)
        peak = torch.cuda.max_memory_allocated(device) - base
        del g
    else:
        with PeakTensorMemory() as mode:
            _, g = _fwd_bwd(fn, s0, t)
            del g
        peak = mode.peak
    return loss, times, max(0, peak - grad_bytes)


def main(argv=None):
    ap = parser(__spec__.name, __doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="tokens (rows of the logits)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="logit dtypes to time, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (the median is reported)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="loss configurations to time, comma-separated")
    ap.add_argument("--teacher-scale", type=float, default=5.0,
                    help="std of the random teacher logits (sets how peaked the teacher is)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random logits")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    for name, allowed in (("dtypes", DTYPES), ("configs", CONFIGS)):
        bad = [x for x in getattr(args, name).split(",") if x not in allowed]
        if bad:
            raise SystemExit(f"--{name}: unknown {bad}; allowed: {','.join(allowed)}")
    if args.tokens < 1 or args.vocab < 2 or args.repeats < 1:
        raise SystemExit("--tokens >= 1, --vocab >= 2 and --repeats >= 1 are required")
    device = torch.device(args.device)
    full_fp32 = args.tokens * args.vocab * 4
    print(f"# logits KD loss: tokens={args.tokens} vocab={args.vocab} device={device} threads="
          f"{torch.get_num_threads()} repeats={args.repeats}; one fp32 [tokens, vocab] = {full_fp32 / 2**20:.0f} MiB")
    header = (f"{'config':<12} {'dtype':<5} {'impl':<24} {'fwd+bwd ms':>11} {'spread':>7} {'x plain':>8} "
              f"{'extra MiB':>10} {'x fp32[N,V]':>11} {'|loss-plain|':>12}")
    print(header)
    print("-" * len(header))
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    t32 = torch.randn(args.tokens, args.vocab, generator=g) * args.teacher_scale
    s32 = t32 + torch.randn(args.tokens, args.vocab, generator=g) * 2.0
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        s0, t = s32.to(device=device, dtype=dtype), t32.to(device=device, dtype=dtype)
        for cname in args.configs.split(","):
            kw = CONFIGS[cname]
            impls = [("plain", lambda s, t, kw=kw: plain_kd(s, t, **kw)),
                     ("kdexp", lambda s, t, kw=kw: logits_kd_loss(s, t, **kw))]
            if cname in ("dense", "topk_renorm"):
                mo = modelopt_kd("dense" if cname == "dense" else "topk", kw.get("top_k"))
                label = "modelopt LogitsKL" if cname == "dense" else "modelopt TopK (renorm)"
                impls.append((label, mo))
            ref_loss = ref_ms = None
            for iname, fn in impls:
                if fn is None:
                    print(f"{cname:<12} {dname:<5} {iname:<24} modelopt: not installed")
                    continue
                loss, times, extra = measure(fn, s0, t, args.repeats)
                ms = statistics.median(times) * 1e3
                spread = (max(times) - min(times)) / statistics.median(times)
                if iname == "plain":
                    ref_loss, ref_ms = loss.float(), ms
                diff = (loss.float() - ref_loss).abs().max().item()
                print(f"{cname:<12} {dname:<5} {iname:<24} {ms:>11.1f} {spread:>6.0%} {ms / ref_ms:>8.2f} "
                      f"{extra / 2**20:>10.1f} {extra / full_fp32:>11.2f} {diff:>12.2e}", flush=True)
            del ref_loss
    print("# spread = (max - min) / median of the timed repeats; |loss-plain| = max per-token difference from the "
          "plain implementation (ModelOpt TopK renormalises over the top-K, like topk_renorm's normalization="
          "'renormalize')")


if __name__ == "__main__":
    main()
