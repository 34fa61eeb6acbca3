"""Random access to a finished teacher cache by training window (sample index), in any order (memory-mapped shards, checksummed on first use).

`TeacherCache(path, key)` opens the manifest (a missing one: the cache is unfinished; a key that differs from this
run's: a `CacheMismatch` naming every entry that differs). A shard is verified against its sha256 the first time a
process touches it, so a truncated or garbled file is a `CacheCorrupt` naming the file, never silently used;
`verify()` checks them all up front. A run opens its cache through kdexp.teacher.writer.ensure, which checks every
shard before training (the ranks share the hashing), rebuilds the damaged ones and `trust`s the rest, so that the
first-use check does not hash them again. `read(sample_index, temperature)` returns the stored record of those samples as
tensors, whatever its record type (kdexp.teacher.format.decode_record). `check_nucleus` checks, before training, that
every cached token's nucleus (loss.top_p without loss.top_k) fits in its cached top-K_max.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from kdexp.data.cache import sha256_file
from kdexp.teacher import format as fmt
from kdexp.track import records


class CacheCorrupt(RuntimeError):
    """A shard file that is missing or fails its size / sha256 check."""


class CacheMismatch(ValueError):
    """A cache built for another format, teacher, data (or data.seed), sequence layout, record type, K_max or draws (count, proposal
    temperature, seed), temperature set or value dtype."""


def check_shard(directory: Path, j: int, want: Optional[dict] = None) -> Optional[str]:
    """None when shard j's files match their checksums (from `want`, else its own shard-j.json), else why not."""
    want = want if want is not None else records.read_json(fmt.shard_file(directory, j, "json"))
    files = want.get("files") if isinstance(want, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{fmt.shard_file(directory, j, 'json')} is missing or unreadable (shard {j} unfinished)"
    for name, meta in sorted(files.items()):
        f = Path(directory) / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != meta.get("bytes"):
            return f"{f} is {f.stat().st_size} bytes, its checksum record says {meta.get('bytes')} (truncated?)"
        digest = sha256_file(f)
        if digest != meta.get("sha256"):
            return f"{f} fails its checksum (sha256 {digest[:12]}..., recorded {str(meta.get('sha256'))[:12]}...)"
    return None


class TeacherCache:
    """A finished cache; `read` is safe to call from any rank (read-only memmaps)."""

    is_teacher_cache = True  # the trainer's step reads this record instead of running a teacher forward

    def __init__(self, path, key: Optional[dict] = None):
        self.path = Path(path)
        manifest = records.read_json(self.path / fmt.MANIFEST)
        if isinstance(manifest, dict) and isinstance(manifest.get("format"), int) and manifest["format"] != fmt.FORMAT:
            raise CacheMismatch(f"teacher cache {self.path} is of format {manifest['format']}, this kdexp reads format "
                                f"{fmt.FORMAT} (records indexed by training window); point teacher.path elsewhere (or "
                                "null for the default location) or delete it")
        if not isinstance(manifest, dict) or manifest.get("format") != fmt.FORMAT:
            raise CacheCorrupt(f"{self.path / fmt.MANIFEST} is missing or unreadable: the teacher cache at "
                               f"{self.path} is unfinished (a rerun of the build resumes it)")
        if key is not None:
            problem = fmt.key_mismatch(key, manifest.get("key"))
            if problem:
                raise CacheMismatch(f"teacher cache {self.path} was built for another run ({problem}); point "
                                    "teacher.path elsewhere (or null for the default location) or delete it")
        self.key = manifest.get("key")
        self.layout = fmt.Layout.from_json(manifest["layout"])
        self._checksums = manifest["shards"]
        self._maps: dict[int, dict[str, np.memmap]] = {}
        self._verified: set[int] = set()  # shards checked in this process (or by the other ranks: `trust`)

    @property
    def k_max(self) -> int:
        return self.layout.k_max

    def temperature_index(self, temperature: float) -> int:
        temps = [float(t) for t in self.layout.temperatures]
        if float(temperature) not in temps:
            raise ValueError(f"loss.temperature={temperature!r} is invalid: the teacher cache {self.path} holds "
                             f"temperatures {temps} only")
        return temps.index(float(temperature))

    def check(self, j: int) -> Optional[str]:
        """None when shard j matches the manifest's checksums (then it is not hashed again here), else why not."""
        if not 0 <= j < self.layout.shards:
            raise IndexError(f"shard {j} is outside the teacher cache's {self.layout.shards} shards")
        problem = check_shard(self.path, j, self._checksums.get(str(j)))
        if problem is None:
            self._verified.add(j)
        return problem

    def trust(self, shards) -> None:
        """Shards another rank of this run has just verified."""
        self._verified.update(shards)

    def _shard(self, j: int) -> dict[str, np.memmap]:
        if j not in self._maps:
            problem = None if j in self._verified else self.check(j)
            if problem:  # damaged after the run opened it (or opened by a tool, not by a run)
                raise CacheCorrupt(f"teacher cache {self.path}: {problem}; rerun: a run checks every shard of its "
                                   "teacher cache before training and rebuilds the damaged ones")
            n = len(self.layout.shard_range(j))
            self._maps[j] = {part: np.memmap(fmt.shard_file(self.path, j, part), dtype=dt, mode="r", shape=shape)
                             for part, (shape, dt) in self.layout.shapes(n).items()}
        return self._maps[j]

    def verify(self) -> None:
        """Check every shard's checksum now (CacheCorrupt naming the first bad file)."""
        for j in range(self.layout.shards):
            self._shard(j)

    def read(self, sample_index, temperature: float, device=None):
        """The stored record of global samples `sample_index` ([b] ints) at a cached `temperature`
        (kdexp.teacher.format.decode_record): topk -> (values [b, s, K] float32, indices [b, s, K] long, lse [b, s],
        lse_rest [b, s]); sampled -> kdexp.losses.sampled.TeacherDraws."""
        ti = None if self.layout.record == "hidden" else self.temperature_index(temperature)  # hidden: any T
        idx = [int(i) for i in (sample_index.tolist() if torch.is_tensor(sample_index) else sample_index)]
        lay = self.layout
        if any(not 0 <= i < lay.samples for i in idx):
            raise IndexError(f"samples {idx} are outside the teacher cache's windows [0, {lay.samples}): a run "
                             "extends its cache to the windows it reads before training (kdexp.teacher.writer.ensure)")
        rows = [(self._shard(i // lay.shard_samples), i % lay.shard_samples) for i in idx]
        out = fmt.decode_record(lay, {part: np.stack([m[part][o] for m, o in rows])
                                      for part in fmt.RECORD_PARTS[lay.record]}, ti)
        if device is None:
            return out
        if torch.is_tensor(out):
            return out.to(device, non_blocking=True)
        moved = [t.to(device, non_blocking=True) for t in out]
        return type(out)(*moved) if hasattr(out, "_fields") else tuple(moved)


def check_nucleus(cache: TeacherCache, *, top_p: float, temperature: float, vocab: int) -> int:
    """Before training (kdexp.objective.sources, right after the cache is built or verified): every cached token's
    nucleus must lie within its cached top-K_max, by the rule the loss applies per batch
    (kdexp.losses.cached.nucleus_overflow), so that an overflow stops the run before its first step, not at the step
    that meets it. ConfigError (exit 2, one line) naming how many tokens overflow and a lower bound on the K_max that
    would serve them. Reads each shard's log-sum-exps (8 bytes per token and temperature) and, for overflowing tokens
    only, their last cached value. Returns the number of tokens checked."""
    from kdexp.losses.cached import nucleus_overflow
    from kdexp.rules import ConfigError

    lay, ti = cache.layout, cache.temperature_index(temperature)
    tokens, count, low, need = 0, 0, 1.0, 0
    for j in range(lay.shards):
        parts = cache._shard(j)
        lse = torch.from_numpy(np.array(parts["lse"][..., ti, :], dtype=np.float32)).reshape(-1, 2)  # a copy
        values = parts["values"].reshape(-1, lay.k_max)  # a memmap: rows are read only when indexed

        def last(short: torch.Tensor, values=values) -> torch.Tensor:
            rows = np.flatnonzero(short.numpy())
            return fmt.decode_values(values[rows, -1], lay.values).reshape(-1)

        over = nucleus_overflow(lse[:, 0], lse[:, 1], top_p, temperature, lay.k_max, vocab, last)
        tokens += lse.shape[0]
        if over is not None:
            count, low, need = count + over[0], min(low, over[1]), max(need, over[2])
    if count:
        raise ConfigError(f"loss.top_p={top_p} does not fit in the teacher cache's top-{lay.k_max} (teacher.k_max="
                          f"{lay.k_max}) for {count} of its {tokens} tokens (their cached mass is below top_p, down "
                          f"to {low:.4g}): build the cache with teacher.k_max >= {need} (a lower bound), or bound the "
                          f"nucleus with loss.top_k <= {lay.k_max}, or use teacher=online; {cache.path}")
    return tokens
