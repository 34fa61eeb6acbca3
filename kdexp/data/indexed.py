"""Megatron indexed datasets (<prefix>.bin + <prefix>.idx) written with megatron-core's own builder.

One document = one sequence = one megatron "document", its tokens followed by the end-of-document id, so
GPTDataset's packing puts an eod between neighbouring documents. Token dtype is megatron's choice for the
vocabulary (uint16 up to 65536 ids, int32 above), the same rule its preprocess_data tool uses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy

__all__ = ["write_indexed", "read_indexed", "indexed_exists", "tokenize_to_indexed"]


def indexed_exists(prefix: str | os.PathLike) -> bool:
    return Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()


def write_indexed(prefix: str | os.PathLike, documents: Iterable[Sequence[int]], vocab_size: int) -> int:
    """Write token-id documents to <prefix>.bin/.idx (no eod added here); returns the number of documents."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    count = 0
    for ids in documents:
        if len(ids) == 0:
            continue  # megatron's sample index cannot step over an empty sequence meaningfully
        builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
        count += 1
    builder.finalize(f"{prefix}.idx")
    if count == 0:
        raise ValueError(f"no non-empty documents to write to {prefix}")
    return count


def tokenize_to_indexed(prefix: str | os.PathLike, texts: Sequence[str], tokenizer, *, batch: int = 256) -> int:
    """Tokenize `texts` (each + eod) into <prefix>.bin/.idx, `batch` texts at a time; returns document count."""

    def docs():
        for start in range(0, len(texts), batch):
            for ids in tokenizer.encode_batch(texts[start:start + batch]):
                if ids:
                    yield ids + [tokenizer.eod]

    return write_indexed(prefix, docs(), tokenizer.vocab_size)


def read_indexed(prefix: str | os.PathLike):
    """megatron-core's IndexedDataset over <prefix>.bin/.idx (memory-mapped)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not indexed_exists(prefix):
        raise ValueError(f"no indexed dataset at prefix {str(prefix)!r} (need {prefix}.bin and {prefix}.idx)")
    return IndexedDataset(str(prefix), multimodal=False, mmap=True)
