"""The CPU kernel of the sparse KD losses (_native.c): built with the system C compiler on first use, run via ctypes.

Why a kernel: on CPU each eager torch op of the sparse loss is a memory-bound pass over a [rows, V] chunk (copy, -inf
scatter, max, sub, floor, exp, sum, gather; scale and scatter in backward), and on the embedded default (K = 1,024
of V = 2,048) those passes were most of the KD step's cost over plain LM training. The kernel forms the same values
one row at a time while the row sits in cache. It serves two cases on CPU with float32 logits and no TP: the Top-K
held-gradient path (logits.holds_gradient: no nucleus cut) and sampled KD (sampled._SparseCE); every other case, and
every case on CUDA, runs the eager code, which stays the reference the tests hold the kernel to.

Build: `$CC` (default `cc`) with -O3 -march=native -fopenmp, into `<kdexp cache>/native/` under a name keyed by the
source, the flags, the compiler and this CPU's feature flags (a home shared by different machines gets one build
per kind of CPU), written to a temp file and renamed into place (concurrent processes may both build; neither reads
a half-written file). No compiler, a failed build or `KDEXP_NATIVE=0`: `kernel()` is None, the eager code runs,
and one warning says why (except for `KDEXP_NATIVE=0`, which is a choice).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kdexp")

SOURCE = Path(__file__).with_name("_native.c")
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared"]
_state: dict = {}
# The K-wide values (teacher log-probs, e, p, the record's slice) of one chunk on the kernel's path: ~4 float32
# arrays of [rows, K + 1]; the kernel works a row at a time, so only these bound the chunk (see logits._LogitsKD).
CHUNK_BYTES = 64 << 20


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    from kdexp import cache_dir
    out_dir = cache_dir() / "native"
    lib = out_dir / f"kdexp_native-{key}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{lib.name}.", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load():
    if os.environ.get("KDEXP_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        log.warning("kdexp: no C compiler (%r) for the CPU Top-K loss kernel: the eager torch code runs (slower on "
                    "CPU, same values); install one (e.g. gcc) or set KDEXP_NATIVE=0 to silence this", cc)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("kdexp: the CPU Top-K loss kernel could not be built or loaded, the eager torch code runs "
                    "(slower on CPU, same values): %s", e)
        return None
    c_long, c_float, c_int, ptr = ctypes.c_long, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
    lib.kd_topk_forward.restype = c_long
    lib.kd_topk_forward.argtypes = [c_long, c_long, c_long, ptr, c_long, ptr, c_long, c_float, ptr, c_long, ptr, ptr,
                                    ptr, c_long, ptr, ptr, c_int]
    lib.kd_topk_backward.restype = None
    lib.kd_topk_backward.argtypes = [c_long, c_long, c_long, ptr, c_long, ptr, c_long, ptr, ptr, ptr, ptr, ptr, c_int]
    lib.kd_sampled_forward.restype = c_long
    lib.kd_sampled_forward.argtypes = [c_long, c_long, c_long, ptr, c_long, ptr, c_long, c_float, ptr, ptr, c_int]
    lib.kd_sampled_backward.restype = None
    lib.kd_sampled_backward.argtypes = [c_long, c_long, c_long, ptr, c_long, c_float, ptr, ptr, ptr, c_long, ptr, ptr,
                                        c_long, c_int]
    return lib


def kernel():
    """The loaded library, or None (built / tried once per process)."""
    if "lib" not in _state:
        _state["lib"] = _load()
    return _state["lib"]


def serves(student: torch.Tensor, held: torch.Tensor | None = None, *, sampled: bool = False) -> bool:
    """Whether the kernel computes this loss: float32 logits on CPU, a kernel at hand, and the Top-K held-gradient
    path (`held`: the gradient's rows) or sampled KD (`sampled`); no TP either way (the caller's condition)."""
    return (held is not None or sampled) and student.device.type == "cpu" and student.dtype == torch.float32 and \
        kernel() is not None


def _rows(t: torch.Tensor, dtype: torch.dtype, cols: int) -> int:
    """t's row stride, after checking it is a [n, cols] tensor of `dtype` with unit column stride (what the kernel
    indexes)."""
    if t.dtype != dtype or t.dim() != 2 or t.shape[1] != cols or (cols > 1 and t.stride(1) != 1):
        raise ValueError(f"native kernel: expected a [n, {cols}] {dtype} tensor with unit column stride, got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    return t.stride(0)


def topk_forward(student: torch.Tensor, idx: torch.Tensor, temperature: float, held: torch.Tensor,
                 a: torch.Tensor | None = None):
    """The student half of one Top-K chunk (see _native.c): fills `held` (exps outside S, 0 on S) and returns
    (e, b, p, row): e = exp(sv) [c, K]; b = the kept log-probs [c, K], or None with `a` (forward KL, which needs only
    sum p (a - b)); p = exp(a) [c, K] or None; row [c, 6] float32 = centre, lns, sum of the held row, lse, total,
    sum p (a - b) (0 without a)."""
    n, v = student.shape
    k = idx.shape[1]
    ss, si, hs = _rows(student, torch.float32, v), _rows(idx, torch.int64, k), _rows(held, torch.float32, v)
    sa = 0 if a is None else _rows(a, torch.float32, k)
    e = torch.empty(n, k, dtype=torch.float32)
    b = torch.empty_like(e) if a is None else None
    p = None if a is None else torch.empty_like(e)
    row = torch.empty(n, 6, dtype=torch.float32)
    bad = kernel().kd_topk_forward(n, v, k, student.data_ptr(), ss, idx.data_ptr(), si, 1.0 / temperature,
                                   held.data_ptr(), hs, e.data_ptr(), None if b is None else b.data_ptr(),
                                   None if a is None else a.data_ptr(), sa, None if p is None else p.data_ptr(),
                                   row.data_ptr(), torch.get_num_threads())
    if bad < 0:
        raise MemoryError("native kernel: out of memory for a row buffer")
    if bad > 0:
        raise IndexError(f"kept-set index out of range [0, {v}) in row {bad - 1} of the chunk: "
                         f"{idx[bad - 1].min().item()}..{idx[bad - 1].max().item()}")
    return e, b, p, row


def topk_backward_(grad: torch.Tensor, idx: torch.Tensor, e: torch.Tensor, p: torch.Tensor, f_out: torch.Tensor,
                   f_s: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """In place on the held rows `grad` [c, V]: grad *= f_out (per row), then grad[idx] = e f_s - p sc."""
    n, v = grad.shape
    k = idx.shape[1]
    gs, si = _rows(grad, torch.float32, v), _rows(idx, torch.int64, k)
    e, p = e.contiguous(), p.contiguous()
    f_out, f_s, sc = (t.reshape(n).float().contiguous() for t in (f_out, f_s, sc))
    kernel().kd_topk_backward(n, v, k, grad.data_ptr(), gs, idx.data_ptr(), si, e.data_ptr(), p.data_ptr(),
                              f_out.data_ptr(), f_s.data_ptr(), sc.data_ptr(), torch.get_num_threads())
    return grad


def sampled_forward(z: torch.Tensor, ids: torch.Tensor, temperature: float):
    """(lse [n], picked [n, S]) of sampled KD (see _native.c): the log-sum-exp of z / T and z / T at the ids."""
    n, v = z.shape
    k = ids.shape[1]
    zs, si = _rows(z, torch.float32, v), _rows(ids, torch.int64, k)
    lse = torch.empty(n, dtype=torch.float32)
    picked = torch.empty(n, k, dtype=torch.float32)
    bad = kernel().kd_sampled_forward(n, v, k, z.data_ptr(), zs, ids.data_ptr(), si, 1.0 / temperature,
                                      lse.data_ptr(), picked.data_ptr(), torch.get_num_threads())
    if bad > 0:
        raise IndexError(f"sampled id out of range [0, {v}) in row {bad - 1}: "
                         f"{ids[bad - 1].min().item()}..{ids[bad - 1].max().item()}")
    return lse, picked


def sampled_backward(z: torch.Tensor, temperature: float, lse: torch.Tensor, coef: torch.Tensor, ids: torch.Tensor,
                     w_neg: torch.Tensor) -> torch.Tensor:
    """The gradient [n, V] of sampled KD: exp(z / T - lse) coef, plus w_neg [n, S] added at the ids."""
    n, v = z.shape
    k = ids.shape[1]
    zs, si = _rows(z, torch.float32, v), _rows(ids, torch.int64, k)
    lse, coef, w_neg = lse.float().contiguous(), coef.float().contiguous(), w_neg.float().contiguous()
    g = torch.empty(n, v, dtype=torch.float32)
    kernel().kd_sampled_backward(n, v, k, z.data_ptr(), zs, 1.0 / temperature, lse.data_ptr(), coef.data_ptr(),
                                 ids.data_ptr(), si, w_neg.data_ptr(), g.data_ptr(), v, torch.get_num_threads())
    return g
