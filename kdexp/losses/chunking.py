"""How many tokens one chunk of a chunked loss holds: every chunk-height rule of kdexp.losses in one place.

The loss kernels (logits, cached, sampled, the CPU kernel's path, the fused head) and kdexp.plan, which sizes a run's
memory by the same heights, all ask here. Each rule bounds the bytes of one chunk's working set: a chunk big enough
that the per-chunk fixed costs (Python, kernel launches, a matmul's pass over the output weight) are amortised, small
enough that the working set stays a small fraction of the whole [tokens, vocab] tensor it replaces.

Under TP every rule is given the largest shard's local vocabulary (Shard.max_local_vocab), so that every rank cuts the
same chunks: the losses communicate per chunk.
"""
from __future__ import annotations

import torch

_MiB = 1 << 20

# The logit KD losses (logits_kd_loss, cached_kd_loss): one chunk's [rows, V/tp + 1] compute-dtype buffer is at most
# 1/LOGIT_FRACTION of the whole, within [LOGIT_MIN_BYTES, LOGIT_MAX_BYTES].
LOGIT_FRACTION = 16
LOGIT_MIN_BYTES = 4 * _MiB
LOGIT_MAX_BYTES = 64 * _MiB

# The fused head (kdexp.losses.head): one chunk of logits is at most 1/CHUNK_FRACTION of the [tokens, V_local]
# accumulation-dtype logits, within [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]. About three chunk-sized tensors are live at
# once (the student chunk, its gradient, the online teacher's chunk), so the head's working set is at most ~3/20 of
# the full logits. Each chunk's matmuls stream the whole output weight, so taller chunks are faster, and heights that
# are a multiple of CHUNK_ALIGN rows run at the BLAS's full speed (docs/objective.md measures both with
# python -m kdexp.bench.head).
CHUNK_FRACTION = 20
CHUNK_ALIGN = 16
MIN_CHUNK_BYTES = 4 * _MiB
MAX_CHUNK_BYTES = 256 * _MiB

# The CPU kernel's path from a teacher cache (kdexp.losses._native): the K-wide values of one chunk (teacher
# log-probs, e, p, the record's slice: ~4 float32 arrays of [rows, K + 1]) within NATIVE_BYTES; the kernel works a row
# at a time, so only these bound the chunk.
NATIVE_BYTES = 64 * _MiB
NATIVE_ROW_BYTES_PER_K = 16  # 4 arrays x 4 bytes per kept entry

# Sampled KD (kdexp.losses.sampled): scratch per chunk of rows (the float64 cumsum when sampling, the float32 softmax
# in backward).
SAMPLED_BYTES = 64 * _MiB


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the fused head forms and accumulates its logits in: float64 stays float64, anything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _equal(n: int, rows: int) -> int:
    """As many chunks as `rows` gives, of equal height: no sliver of a last chunk (2 of 1,024 rows)."""
    return -(-n // -(-n // rows))


def logit_rows(n: int, local_vocab: int, cdtype: torch.dtype, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk of a logit loss over `n` tokens: `chunk_tokens` if given, else a working set of at most
    1/LOGIT_FRACTION of one [n, local_vocab + 1] compute-dtype tensor, within [LOGIT_MIN_BYTES, LOGIT_MAX_BYTES], in
    equal chunks."""
    if n == 0:  # no tokens: no chunk (the loss is an empty per-token tensor, its gradient empty)
        return 1
    if chunk_tokens is not None:
        return max(1, min(n, chunk_tokens))
    row = (local_vocab + 1) * torch.finfo(cdtype).bits // 8
    budget = min(LOGIT_MAX_BYTES, max(LOGIT_MIN_BYTES, n * row // LOGIT_FRACTION))
    return _equal(n, max(1, min(n, budget // row)))


def head_rows(n: int, local_vocab: int, dtype: torch.dtype, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk of the fused head: `chunk_tokens` if given, else the CHUNK_FRACTION rule above on logits in
    the accumulation dtype of `dtype` (float64 stays float64, else float32), as a multiple of CHUNK_ALIGN (when the
    budget allows one) with as few chunks and as short a last chunk as that allows."""
    if chunk_tokens is not None:
        return max(1, min(n, chunk_tokens))
    row = local_vocab * torch.finfo(accumulation_dtype(dtype)).bits // 8
    budget = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, n * row // CHUNK_FRACTION))
    rows = max(1, min(n, budget // row))
    align = CHUNK_ALIGN if CHUNK_ALIGN <= rows < n else 1
    rows -= rows % align
    return -(-_equal(n, rows) // align) * align  # the equal height rounded up to the alignment (never above rows)


def native_rows(n: int, rows: int, top_k: int) -> int:
    """Tokens per chunk on the CPU kernel's path from a cache: no [rows, V] eager pass is left to keep in cache, so
    one chunk of up to NATIVE_BYTES of K-wide values (never fewer rows than the logit rule's `rows`) runs the per-row
    glue once instead of once per chunk."""
    return max(1, min(n, max(rows, NATIVE_BYTES // (NATIVE_ROW_BYTES_PER_K * (top_k + 1)))))


def sampled_rows(n: int, per_row_bytes: int) -> int:
    """Tokens per chunk of sampled KD's passes over the vocabulary: SAMPLED_BYTES of scratch."""
    return max(1, min(n, SAMPLED_BYTES // max(1, per_row_bytes)))
