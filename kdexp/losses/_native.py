"""The CPU kernel of the sparse KD losses (_native.c): built with the system C compiler on first use, run via ctypes.

Why a kernel: on CPU each eager torch op of the sparse loss is a memory-bound pass over a [rows, V] chunk (copy, -inf
scatter, max, sub, floor, exp, sum, gather; scale and scatter in backward), and on the embedded default (K = 1,024
of V = 2,048) those passes were most of the KD step's cost over plain LM training. The kernel forms the same values
one row at a time while the row sits in cache. It serves two cases on CPU with float32 logits and no TP: the Top-K
held-gradient path (_chunks.holds_gradient: no nucleus cut) and sampled KD (sampled._SparseCE); every other case, and
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
import math
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
    lib.kd_topk_backward.restype = c_long
    lib.kd_topk_backward.argtypes = [c_long, c_long, c_long, ptr, c_long, ptr, c_long, ptr, ptr, ptr, ptr, ptr, c_int]
    lib.kd_sampled_forward.restype = c_long
    lib.kd_sampled_forward.argtypes = [c_long, c_long, c_long, ptr, c_long, ptr, c_long, c_float, ptr, ptr, ptr,
                                       c_int]
    lib.kd_sampled_backward.restype = c_long
    lib.kd_sampled_backward.argtypes = [c_long, c_long, c_long, ptr, c_long, c_float, ptr, ptr, ptr, ptr, c_long, ptr,
                                        ptr, c_long, c_int]
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


def _rows(t: torch.Tensor, dtype: torch.dtype, n: int, cols: int, *, written: bool = False) -> int:
    """t's row stride, after checking it is a CPU [n, cols] tensor of `dtype` with unit column stride (what the
    kernel indexes); a tensor the kernel writes must not have overlapping rows either. Every pointer the C code
    follows is bounded by these checks and by the ids it checks itself: no input reaches memory outside a tensor."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != dtype or t.dim() != 2 or \
            tuple(t.shape) != (n, cols) or (n > 0 and cols > 1 and t.stride(1) != 1) or \
            (written and n > 1 and t.stride(0) < cols):
        raise ValueError(f"native kernel: expected a CPU [{n}, {cols}] {dtype} tensor with unit column stride"
                         f"{' and disjoint rows' if written else ''}, got {getattr(t, 'shape', t)!r} "
                         f"{getattr(t, 'dtype', '')} {getattr(t, 'device', '')} strides "
                         f"{t.stride() if isinstance(t, torch.Tensor) else ''}")
    return t.stride(0)


def _vector(t: torch.Tensor, n: int) -> torch.Tensor:
    """A per-row value as the kernel reads it: [n] float32, contiguous."""
    t = t.reshape(-1).float().contiguous()
    if t.shape[0] != n:
        raise ValueError(f"native kernel: expected {n} per-row values, got {t.shape[0]}")
    return t


def _ids(idx: torch.Tensor, n: int) -> int:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != n or idx.shape[1] < 1:
        raise ValueError(f"native kernel: expected [{n}, K >= 1] ids, got {getattr(idx, 'shape', idx)!r}")
    return idx.shape[1]


def _temperature(temperature: float) -> float:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"native kernel: temperature must be a finite number > 0, got {temperature!r}")
    return 1.0 / float(temperature)


def _out_of_range(what: str, idx: torch.Tensor, bad: int, v: int) -> IndexError:
    row = idx[bad - 1]
    return IndexError(f"{what} out of range [0, {v}) in row {bad - 1} of the chunk: {row.min().item()}.."
                      f"{row.max().item()}")


def topk_forward(student: torch.Tensor, idx: torch.Tensor, temperature: float, held: torch.Tensor,
                 a: torch.Tensor | None = None):
    """The student half of one Top-K chunk (see _native.c): fills `held` (exps outside S, 0 on S) and returns
    (e, b, p, row): e = exp(sv) [c, K]; b = the kept log-probs [c, K], or None with `a` (forward KL, which needs only
    sum p (a - b)); p = exp(a) [c, K] or None; row [c, 6] float32 = centre, lns, sum of the held row, lse, total,
    sum p (a - b) (0 without a). An id outside [0, V): IndexError; a malformed tensor: ValueError."""
    if not isinstance(student, torch.Tensor) or student.dim() != 2:
        raise ValueError(f"native kernel: expected [n, V] student logits, got {getattr(student, 'shape', student)!r}")
    n, v = student.shape
    k = _ids(idx, n)
    inv_t = _temperature(temperature)
    ss, si = _rows(student, torch.float32, n, v), _rows(idx, torch.int64, n, k)
    hs = _rows(held, torch.float32, n, v, written=True)
    sa = 0 if a is None else _rows(a, torch.float32, n, k)
    e = torch.empty(n, k, dtype=torch.float32)
    b = torch.empty_like(e) if a is None else None
    p = None if a is None else torch.empty_like(e)
    row = torch.empty(n, 6, dtype=torch.float32)
    bad = kernel().kd_topk_forward(n, v, k, student.data_ptr(), ss, idx.data_ptr(), si, inv_t,
                                   held.data_ptr(), hs, e.data_ptr(), None if b is None else b.data_ptr(),
                                   None if a is None else a.data_ptr(), sa, None if p is None else p.data_ptr(),
                                   row.data_ptr(), torch.get_num_threads())
    if bad < 0:
        raise MemoryError("native kernel: out of memory for a row buffer")
    if bad > 0:
        raise _out_of_range("kept-set index", idx, bad, v)
    return e, b, p, row


def topk_backward_(grad: torch.Tensor, idx: torch.Tensor, e: torch.Tensor, p: torch.Tensor, f_out: torch.Tensor,
                   f_s: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """In place on the held rows `grad` [c, V]: grad *= f_out (per row), then grad[idx] = e f_s - p sc. The ids are
    checked again in C (the caller's tensor could have changed since the forward): IndexError."""
    if not isinstance(grad, torch.Tensor) or grad.dim() != 2:
        raise ValueError(f"native kernel: expected an [n, V] gradient, got {getattr(grad, 'shape', grad)!r}")
    n, v = grad.shape
    k = _ids(idx, n)
    gs, si = _rows(grad, torch.float32, n, v, written=True), _rows(idx, torch.int64, n, k)
    e, p = e.contiguous(), p.contiguous()
    _rows(e, torch.float32, n, k), _rows(p, torch.float32, n, k)
    f_out, f_s, sc = (_vector(t, n) for t in (f_out, f_s, sc))
    bad = kernel().kd_topk_backward(n, v, k, grad.data_ptr(), gs, idx.data_ptr(), si, e.data_ptr(), p.data_ptr(),
                                    f_out.data_ptr(), f_s.data_ptr(), sc.data_ptr(), torch.get_num_threads())
    if bad > 0:
        raise _out_of_range("kept-set index", idx, bad, v)
    return grad


def sampled_forward(z: torch.Tensor, ids: torch.Tensor, temperature: float):
    """(centre [n], lse [n], picked [n, S]) of sampled KD (see _native.c): the row max, the log-sum-exp of
    (z - centre) / T and (z - centre) / T at the ids. An id outside [0, V): IndexError."""
    if not isinstance(z, torch.Tensor) or z.dim() != 2:
        raise ValueError(f"native kernel: expected [n, V] logits, got {getattr(z, 'shape', z)!r}")
    n, v = z.shape
    k = _ids(ids, n)
    inv_t = _temperature(temperature)
    zs, si = _rows(z, torch.float32, n, v), _rows(ids, torch.int64, n, k)
    centre = torch.empty(n, dtype=torch.float32)
    lse = torch.empty(n, dtype=torch.float32)
    picked = torch.empty(n, k, dtype=torch.float32)
    bad = kernel().kd_sampled_forward(n, v, k, z.data_ptr(), zs, ids.data_ptr(), si, inv_t, centre.data_ptr(),
                                      lse.data_ptr(), picked.data_ptr(), torch.get_num_threads())
    if bad > 0:
        raise _out_of_range("sampled id", ids, bad, v)
    return centre, lse, picked


def sampled_backward(z: torch.Tensor, temperature: float, centre: torch.Tensor, lse: torch.Tensor,
                     coef: torch.Tensor, ids: torch.Tensor, w_neg: torch.Tensor) -> torch.Tensor:
    """The gradient [n, V] of sampled KD: exp((z - centre) / T - lse) coef, plus w_neg [n, S] added at the ids."""
    if not isinstance(z, torch.Tensor) or z.dim() != 2:
        raise ValueError(f"native kernel: expected [n, V] logits, got {getattr(z, 'shape', z)!r}")
    n, v = z.shape
    k = _ids(ids, n)
    inv_t = _temperature(temperature)
    zs, si = _rows(z, torch.float32, n, v), _rows(ids, torch.int64, n, k)
    centre, lse, coef = (_vector(t, n) for t in (centre, lse, coef))
    w_neg = w_neg.float().contiguous()
    _rows(w_neg, torch.float32, n, k)
    g = torch.empty(n, v, dtype=torch.float32)
    bad = kernel().kd_sampled_backward(n, v, k, z.data_ptr(), zs, inv_t, centre.data_ptr(), lse.data_ptr(),
                                       coef.data_ptr(), ids.data_ptr(), si, w_neg.data_ptr(), g.data_ptr(), v,
                                       torch.get_num_threads())
    if bad > 0:
        raise _out_of_range("sampled id", ids, bad, v)
    return g
