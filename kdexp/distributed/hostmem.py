"""Host allocator policy for CPU runs: glibc malloc keeps freed large blocks for reuse.

A train step allocates and frees the same multi-MB tensors every step (logits, their gradient, the KD loss's
values, a teacher-cache record). glibc serves blocks above its mmap threshold (128 KiB, raised dynamically up to
32 MiB) with a fresh mmap and unmaps them on free, and trims the heap's free top back to the OS, so each step
first-touches those pages again: thousands of page faults per step, each zeroing a page. With the threshold at
1 GiB and trimming off, freed blocks stay in the heap and are reused (PyTorch's CPU tuning guide reaches the same
end by preloading jemalloc or tcmalloc). The cost: the process keeps its peak heap instead of returning it, which a
training process reaches every step anyway.

Applied by kdexp.distributed.initialize on CPU runs only (a GPU run's large buffers are device memory). Skipped
when the environment already sets glibc's own knobs (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or the
glibc.malloc tunables), when KDEXP_HOST_MALLOC=0, or when the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, i.e. never trim


@functools.cache
def keep_freed_memory() -> bool:
    """Set the policy above once per process; True when it is in force (set now or before)."""
    ok = False
    user = any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or \
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if os.environ.get("KDEXP_HOST_MALLOC", "1").strip() != "0" and not user:
        try:
            mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return ok
