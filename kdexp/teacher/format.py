"""On-disk format of the offline teacher cache: shard layout, value and index encodings, the key and its manifest.

A cache directory holds, for training windows [0, samples) (kdexp.data: the samples data.seed fixes, read by any
trainer.seed in its own order, kdexp.data.ReadOrder), shards of `shard_samples` consecutive samples. A run that reads
more windows than a cache holds extends it (kdexp.teacher.writer); one that reads fewer reads its prefix. Shard j is raw little-endian arrays (numpy memmaps, no header), one
file per part of its record type (`layout["record"]`, `RECORD_PARTS`):

"topk" (the logit losses: kdexp.losses.cached), K = k_max slots per token:
    shard-0000j.values   [n, seq, K]      float32 (exact) | bfloat16 / float16 (compact, stored as their 16 bits)
    shard-0000j.indices  [n, seq, K * B]  global vocabulary ids in B = index_bytes(vocab) bytes (1, 2, 3 or 4)
    shard-0000j.lse      [n, seq, T, 2]   float32: per cached temperature, log-sum-exp of the centred logits / T over
                                          the whole vocabulary and over the complement of the top-K set
(values are the teacher's top-K logits centred on the row max, sorted descending). Bytes per token: K (E + B) + 8 T,
E the value bytes (4, or 2 compact).

"sampled" (sampled KD, RS-KD: kdexp.losses.sampled.draw_teacher), S = draws (loss.samples) slots per token:
    shard-0000j.values   [n, seq, S]      the teacher's centred logit of each drawn id (dtype as above; 0 if unused)
    shard-0000j.indices  [n, seq, S * B]  the distinct drawn ids, sorted, packed left (unused slots repeat the first)
    shard-0000j.counts   [n, seq, S]      draws per id in C = count_bytes(S) bytes (uint8 up to 255 draws); 0 = unused
    shard-0000j.lse      [n, seq, T + 1]  float32: per cached temperature log sum exp(centred / T) over the whole
                                          vocabulary (p's log-normaliser), then the proposal's (at
                                          proposal_temperature)
Bytes per token: S (E + B + C) + 4 (T + 1). From these, kdexp.losses.sampled.weigh rebuilds log p_T of every drawn
id, log p/q, the importance weights (normalised or not: loss.normalize_weights is read time) and so the loss, as
`sample_teacher` computes them online, for any cached loss temperature. The draws of global sample i come from the
generator seeded `draw_seed(layout.draw_seed, i)` (data.seed, as the windows: the draws are part of what the cache
holds, so every trainer.seed of a sweep reads one cache): fixed at build time whatever the DP size or micro-batch
size, and the same draws are reused every epoch / sweep point (an online run draws afresh per step, from trainer.seed).

"hidden" (teacher.store=hidden: every logit loss, cut and temperature), H = the teacher's hidden size:
    shard-0000j.values   [n, seq, H]      the teacher's final hidden states (after its final norm), in its params
                                          dtype (float32, or bfloat16 stored as its 16 bits)
Bytes per token: H E. The objective forms the teacher's logits from them with the teacher's own output layer, chunk by
chunk, as the online teacher's fused path does (kdexp.objective.sources.HiddenCacheTeacher), so every loss family,
K, nucleus and temperature is served as online.

Each finished shard gets `shard-0000j.json` (size + sha256 of its files), written atomically after them: a shard
without one is unfinished and rewritten by a resumed build. `manifest.json` (format, key, layout, every shard's
checksums), written last, marks the cache complete.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from kdexp.losses.sampled import TeacherDraws, step_seed

# 3: record i is the teacher on training window i (fixed by data.seed), whatever order a run reads the windows in;
# a format-2 cache held "sample i of the run's shuffled stream" (which followed trainer.seed), so it is not read
FORMAT = 3
MANIFEST = "manifest.json"
VALUE_DTYPES = ("float32", "bfloat16", "float16")
_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECORD_PARTS = {"topk": ("values", "indices", "lse"), "sampled": ("values", "indices", "counts", "lse"),
                "hidden": ("values",)}
STORES = tuple(RECORD_PARTS)  # teacher.store


def index_bytes(vocab: int) -> int:
    """The fewest whole bytes that hold every id of a `vocab`-entry vocabulary (Qwen3's 151,936 -> 3)."""
    for nb in (1, 2, 3, 4):
        if vocab <= 1 << (8 * nb):
            return nb
    raise ValueError(f"vocabulary size {vocab} does not fit 32-bit indices")


def count_bytes(draws: int) -> int:
    """The smallest unsigned integer (1, 2 or 4 bytes) that holds a count of up to `draws` draws."""
    for nb in (1, 2, 4):
        if draws < 1 << (8 * nb):
            return nb
    raise ValueError(f"{draws} draws per token do not fit 32-bit counts")


def draw_seed(seed: int, sample_index: int) -> int:
    """The generator seed of the draws of global sample `sample_index` in a "sampled" cache built with `seed`."""
    return step_seed(seed, sample_index)


@dataclass(frozen=True)
class Layout:
    samples: int  # training windows cached: [0, samples)
    seq_length: int
    k_max: int
    temperatures: tuple
    values: str  # one of VALUE_DTYPES
    index_bytes: int
    shard_samples: int
    record: str = "topk"  # a key of RECORD_PARTS
    # "sampled" only (k_max is 0 there): draws per token (loss.samples), their proposal temperature and base seed
    draws: Optional[int] = None
    proposal_temperature: Optional[float] = None
    draw_seed: Optional[int] = None
    hidden_size: Optional[int] = None  # "hidden" only

    def __post_init__(self):
        if self.record not in RECORD_PARTS:
            raise ValueError(f"record={self.record!r} is not a teacher-cache record type ({', '.join(RECORD_PARTS)})")
        if self.record == "sampled" and None in (self.draws, self.proposal_temperature, self.draw_seed):
            raise ValueError("a sampled record needs draws, proposal_temperature and draw_seed")
        if self.record == "hidden" and self.hidden_size is None:
            raise ValueError("a hidden record needs hidden_size")

    @property
    def slots(self) -> int:
        """Entries per token: K_max ids (topk), the draws (sampled: at most that many distinct ids), or H values."""
        return {"topk": self.k_max, "sampled": self.draws, "hidden": self.hidden_size}[self.record]

    @property
    def shards(self) -> int:
        return -(-self.samples // self.shard_samples)

    def shard_range(self, j: int) -> range:
        return range(j * self.shard_samples, min(self.samples, (j + 1) * self.shard_samples))

    def grown(self, samples: int) -> "Layout":
        """This layout over `samples` windows (a cache extended to serve a longer run)."""
        return Layout.from_json({**self.to_json(), "samples": int(samples)})

    def row_bytes(self) -> dict[str, int]:
        """File part -> bytes per sample: a shard of n samples holds n times as many (kdexp.teacher.writer checks a
        kept shard's files against them, so a shard of another sample count is never kept)."""
        return {part: int(np.prod(shape[1:])) * dt.itemsize for part, (shape, dt) in self.shapes(1).items()}

    def bytes_per_token(self) -> int:
        if self.record == "hidden":
            return self.hidden_size * _VALUE_BYTES[self.values]
        entry = _VALUE_BYTES[self.values] + self.index_bytes
        if self.record == "topk":
            return self.k_max * entry + 8 * len(self.temperatures)
        return self.draws * (entry + count_bytes(self.draws)) + 4 * (len(self.temperatures) + 1)

    def decoded_bytes_per_token(self) -> int:
        """What `decode_record` hands the loss per token, on the device, at one temperature (kdexp.plan counts it in
        place of the teacher's logits): topk K float32 values + K int64 ids + 2 float32 log-sum-exps; sampled S int64
        ids + S int64 counts + S float32 centred logits + 2 float32 log-normalisers (S = draws)."""
        if self.record == "topk":
            return self.k_max * (4 + 8) + 2 * 4
        if self.record == "hidden":
            return self.hidden_size * 4
        return self.draws * (8 + 8 + 4) + 2 * 4

    def shapes(self, n: int) -> dict[str, tuple[tuple, np.dtype]]:
        """File name suffix -> (shape, numpy dtype) of a shard of `n` samples."""
        s, k, nt = self.seq_length, self.slots, len(self.temperatures)
        vdt = np.dtype("<f4") if self.values == "float32" else np.dtype("<u2")
        if self.record == "hidden":
            return {"values": ((n, s, k), vdt)}
        idt = np.dtype({1: "<u1", 2: "<u2", 4: "<u4"}.get(self.index_bytes, "<u1"))
        iw = k if self.index_bytes != 3 else 3 * k
        out = {"values": ((n, s, k), vdt), "indices": ((n, s, iw), idt)}
        if self.record == "topk":
            return {**out, "lse": ((n, s, nt, 2), np.dtype("<f4"))}
        cdt = np.dtype({1: "<u1", 2: "<u2", 4: "<u4"}[count_bytes(self.draws)])
        return {**out, "counts": ((n, s, k), cdt), "lse": ((n, s, nt + 1), np.dtype("<f4"))}

    def key_entries(self) -> dict:
        """What of the layout keys the cache besides the common entries (kdexp.teacher.writer.cache_key): top-K's
        K_max; the sampled draws' count, proposal temperature and seed (named after their config keys)."""
        if self.record == "topk":
            return {"k_max": self.k_max}
        if self.record == "hidden":
            return {"hidden_size": self.hidden_size}
        return {"loss.samples": self.draws, "loss.proposal_temperature": self.proposal_temperature,
                "draw_seed": self.draw_seed}

    def describe(self) -> str:
        if self.record == "topk":
            return f"top-{self.k_max}"
        if self.record == "hidden":
            return f"final hidden states of size {self.hidden_size}"
        return f"{self.draws} draws per token at proposal temperature {self.proposal_temperature}, seed {self.draw_seed}"

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}  # a topk manifest is what it always was
        d["temperatures"] = list(self.temperatures)
        return d

    @staticmethod
    def store(cfg) -> str:
        """teacher.store, or when null what the loss needs: "sampled" with loss.samples set, else "topk"."""
        if cfg.teacher.store is not None:
            return str(cfg.teacher.store)
        return "topk" if cfg.loss.samples is None else "sampled"

    @staticmethod
    def from_config(cfg, vocab: int, samples: int, hidden_size: Optional[int] = None,
                    hidden_dtype: str = "float32") -> "Layout":
        """The layout a run's config asks for (`samples` windows of a `vocab`-entry vocabulary) by `store`: "topk",
        "sampled" (teacher.k_max irrelevant), or "hidden" (the teacher's `hidden_size` values per token in its params
        dtype `hidden_dtype`; temperatures and teacher.dtype play no part). kdexp.teacher.writer builds caches by it
        and kdexp.plan sizes their records by it."""
        tc, loss = cfg.teacher, cfg.loss
        common = dict(samples=samples, seq_length=int(cfg.trainer.seq_length), index_bytes=index_bytes(vocab),
                      shard_samples=tc.shard_samples)
        store = Layout.store(cfg)
        if store == "hidden":
            if hidden_size is None:
                raise ValueError("teacher.store=hidden: the teacher's hidden size is needed to lay out its records")
            return Layout(k_max=0, record="hidden", hidden_size=int(hidden_size), temperatures=(), values=hidden_dtype,
                          **common)
        common.update(temperatures=tuple(float(x) for x in tc.temperatures), values=tc.dtype)
        if store == "topk":
            return Layout(k_max=tc.k_max, **common)
        return Layout(k_max=0, record="sampled", draws=int(loss.samples),
                      proposal_temperature=float(loss.proposal_temperature), draw_seed=int(cfg.data.seed), **common)

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
    if nb != 3:  # widened by torch (threaded, vectorised) rather than numpy's single-threaded astype
        return torch.from_numpy(np.ascontiguousarray(a)).to(torch.int64)
    b = np.ascontiguousarray(a).reshape(*a.shape[:-1], a.shape[-1] // 3, 3).astype(np.int64)
    return torch.from_numpy(b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16))


# --------------------------------------------------------------------------------------------------- records

def encode_record(layout: Layout, rec) -> dict[str, np.ndarray]:
    """Part -> array of one batch of records: a kdexp.losses.cached.TeacherRecord (topk) or a
    kdexp.losses.sampled.TeacherDraws over the layout's temperatures (sampled), [b, seq, ...] each."""
    if layout.record == "hidden":
        return {"values": encode_values(rec, layout.values)}
    if layout.record == "topk":
        return {"values": encode_values(rec.values, layout.values),
                "indices": encode_indices(rec.indices, layout.index_bytes),
                "lse": torch.stack([rec.lse, rec.lse_rest], -1).to("cpu", torch.float32).numpy()}
    cdt = {1: "<u1", 2: "<u2", 4: "<u4"}[count_bytes(layout.draws)]
    return {"values": encode_values(rec.centred, layout.values),
            "indices": encode_indices(rec.ids, layout.index_bytes),
            "counts": rec.counts.to("cpu").numpy().astype(cdt),
            "lse": torch.cat([rec.log_zp, rec.log_zq[..., None]], -1).to("cpu", torch.float32).numpy()}


def decode_record(layout: Layout, parts: dict[str, np.ndarray], ti: int):
    """The stored record of a batch at cached temperature index `ti`: topk -> (values [b, s, K] float32, indices
    [b, s, K] long, lse [b, s], lse_rest [b, s]); sampled -> TeacherDraws with log_zp [b, s, 1] (at that
    temperature), what kdexp.losses.sampled.weigh takes."""
    values = decode_values(parts["values"], layout.values)
    if layout.record == "hidden":
        return values
    indices = decode_indices(parts["indices"], layout.index_bytes)
    lse = torch.from_numpy(np.ascontiguousarray(parts["lse"]))
    if layout.record == "topk":
        return values, indices, lse[..., ti, 0].contiguous(), lse[..., ti, 1].contiguous()
    counts = torch.from_numpy(np.ascontiguousarray(parts["counts"]).astype(np.int64))
    return TeacherDraws(indices, counts, values, lse[..., ti:ti + 1].contiguous(), lse[..., -1].contiguous())


# ------------------------------------------------------------------------------------------------------- key

def key_mismatch(want: dict, have: Any) -> Optional[str]:
    """None when the stored key `have` equals `want`, else which entries differ (cache value vs this run's)."""
    if not isinstance(have, dict):
        return f"the cache has no readable key ({have!r})"
    diffs = [f"{k}: cache {have.get(k, '<absent>')!r}, this run {want.get(k, '<absent>')!r}"
             for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
    return "; ".join(diffs) or None
