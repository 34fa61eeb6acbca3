"""On-disk format of the offline teacher cache: shard layout, value and index encodings, the key and its manifest.

A cache directory holds, for global samples [0, samples) of the run's training stream (kdexp.data.batches order),
shards of `shard_samples` consecutive samples. Shard j is three raw little-endian arrays (numpy memmaps, no header):

    shard-0000j.values   [n, seq, K]      float32 (exact) | bfloat16 / float16 (compact, stored as their 16 bits)
    shard-0000j.indices  [n, seq, K * B]  global vocabulary ids in B = index_bytes(vocab) bytes (1, 2, 3 or 4)
    shard-0000j.lse      [n, seq, T, 2]   float32: per cached temperature, log-sum-exp of the centred logits / T over
                                          the whole vocabulary and over the complement of the top-K set

(values are the teacher's top-K logits centred on the row max, sorted descending: kdexp.losses.cached). Bytes per
token: K * (value bytes + B) + 8 T. Each finished shard gets `shard-0000j.json` (size + sha256 of its three files),
written atomically after them: a shard without one is unfinished and rewritten by a resumed build. `manifest.json`
(format, key, layout, every shard's checksums), written last, marks the cache complete.

Record types: `layout["record"]` names what a shard holds; "topk" is the only one written today. Another type (e.g.
"sampled": importance-sampled teacher ids with counts) adds its own arrays to `RECORD_PARTS` and keeps the rest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

FORMAT = 1
MANIFEST = "manifest.json"
VALUE_DTYPES = ("float32", "bfloat16", "float16")
_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECORD_PARTS = {"topk": ("values", "indices", "lse")}


def index_bytes(vocab: int) -> int:
    """The fewest whole bytes that hold every id of a `vocab`-entry vocabulary (Qwen3's 151,936 -> 3)."""
    for nb in (1, 2, 3, 4):
        if vocab <= 1 << (8 * nb):
            return nb
    raise ValueError(f"vocabulary size {vocab} does not fit 32-bit indices")


@dataclass(frozen=True)
class Layout:
    samples: int  # global samples cached: [0, samples)
    seq_length: int
    k_max: int
    temperatures: tuple
    values: str  # one of VALUE_DTYPES
    index_bytes: int
    shard_samples: int
    record: str = "topk"

    @property
    def shards(self) -> int:
        return -(-self.samples // self.shard_samples)

    def shard_range(self, j: int) -> range:
        return range(j * self.shard_samples, min(self.samples, (j + 1) * self.shard_samples))

    def bytes_per_token(self) -> int:
        return self.k_max * (_VALUE_BYTES[self.values] + self.index_bytes) + 8 * len(self.temperatures)

    def shapes(self, n: int) -> dict[str, tuple[tuple, np.dtype]]:
        """File name suffix -> (shape, numpy dtype) of a shard of `n` samples."""
        s, k = self.seq_length, self.k_max
        vdt = np.dtype("<f4") if self.values == "float32" else np.dtype("<u2")
        idt = np.dtype({1: "<u1", 2: "<u2", 4: "<u4"}.get(self.index_bytes, "<u1"))
        iw = k if self.index_bytes != 3 else 3 * k
        return {"values": ((n, s, k), vdt), "indices": ((n, s, iw), idt),
                "lse": ((n, s, len(self.temperatures), 2), np.dtype("<f4"))}

    def to_json(self) -> dict:
        d = asdict(self)
        d["temperatures"] = list(self.temperatures)
        return d

    @staticmethod
    def from_json(d: dict) -> "Layout":
        return Layout(**{**d, "temperatures": tuple(d["temperatures"])})


def shard_file(directory: Path, j: int, part: str) -> Path:
    return Path(directory) / f"shard-{j:05d}.{part}"


# ------------------------------------------------------------------------------------------------- encodings

def encode_values(x: torch.Tensor, dtype: str) -> np.ndarray:
    x = x.detach().to("cpu", torch.float32)
    if dtype == "float32":
        return x.numpy()
    t = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    return x.to(t).view(torch.int16).numpy().view(np.uint16)


def decode_values(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype == "float32":
        return t
    return t.view(torch.int16).view(torch.bfloat16 if dtype == "bfloat16" else torch.float16).float()


def encode_indices(idx: torch.Tensor, nb: int) -> np.ndarray:
    a = idx.detach().to("cpu", torch.int64).numpy()
    if nb != 3:
        return a.astype({1: "<u1", 2: "<u2", 4: "<u4"}[nb])
    b = a.astype("<u4").view(np.uint8).reshape(*a.shape, 4)[..., :3]  # little-endian: drop the high byte
    return np.ascontiguousarray(b).reshape(*a.shape[:-1], 3 * a.shape[-1])


def decode_indices(a: np.ndarray, nb: int) -> torch.Tensor:
    if nb != 3:
        return torch.from_numpy(np.ascontiguousarray(a).astype(np.int64))
    b = np.ascontiguousarray(a).reshape(*a.shape[:-1], a.shape[-1] // 3, 3).astype(np.int64)
    return torch.from_numpy(b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16))


# ------------------------------------------------------------------------------------------------------- key

def key_mismatch(want: dict, have: Any) -> Optional[str]:
    """None when the stored key `have` equals `want`, else which entries differ (cache value vs this run's)."""
    if not isinstance(have, dict):
        return f"the cache has no readable key ({have!r})"
    diffs = [f"{k}: cache {have.get(k, '<absent>')!r}, this run {want.get(k, '<absent>')!r}"
             for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
    return "; ".join(diffs) or None
