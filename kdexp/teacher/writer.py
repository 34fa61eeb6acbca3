"""Build the offline teacher cache: one teacher pass over the training windows a run reads, once per teacher and data.

`ensure(cfg, data, teacher, teacher_identity)` returns the run's `TeacherCache`, building it first when it is missing or unfinished.
Record i is the teacher on training window i of `data.train_ds` (the samples data.seed fixes, kdexp.data); a run of
max_steps x global batch positions reads windows [0, data.windows(positions)) in its trainer.seed's order
(kdexp.data.ReadOrder), so every replicate of a seed sweep, any DP size, micro or global batch reads one cache:

- indexed by sample, not by position: the key names the teacher, the data (fingerprint, data.seed, the epoch's
  windows), seq length and the record, never the run's seed, length or batch; the manifest names the windows held;
- extended, not rebuilt: a run that reads more windows than the cache holds writes only the missing ones (the short
  last shard again, then new shards); one that reads fewer reads its prefix;

- the record type is teacher.store, by default the loss's: "topk" for the logit losses, "sampled" when loss.samples
  is set (the draws made here, once, per window: kdexp.teacher.format); "hidden" (the teacher's final hidden states,
  any loss) when asked for;
- keyed (`cache_key`): teacher identity (handed in by whoever made the teacher), data fingerprint, data.seed and the
  epoch's windows, seq length, vocabulary, record type and its own entries (K_max; or loss.samples,
  loss.proposal_temperature and the draw seed), temperatures, value dtype.
  The default location is a hash of the key under paths.cache; an explicit teacher.path holding another key is a
  `CacheMismatch` naming what differs;
- one builder: global rank 0 holds the cache's flock (kdexp.data.cache.exclusive) from check to manifest, so
  concurrent sweep points on a cold cache wait, then share it;
- shard j is written by TP rank 0 of DP group j % dp_size (its TP ranks gather the vocab-parallel top-K inside
  kdexp.losses.cached.teacher_topk_record, or make the same draws in kdexp.losses.sampled.draw_teacher), into temp
  files renamed into place, then its checksum record;
- resumable: a killed build keeps its finished (checksum-verified) shards; a rerun writes only the others;
- global rank 0 writes manifest.json last;
- verified before training: a finished cache's shards are checked against the manifest's sizes and sha256 when a run
  opens it, each rank hashing every world_size-th shard (the same hashing each rank did on first use before, now
  shared); a damaged or missing shard is rebuilt, and only that shard, before the first step.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from kdexp import distributed, models
from kdexp.data import cache as data_cache
from kdexp.data.cache import sha256_file
from kdexp.losses.cached import teacher_topk_record
from kdexp.losses.sampled import TeacherDraws, draw_teacher
from kdexp.teacher import format as fmt
from kdexp.teacher.reader import CacheMismatch, TeacherCache, check_shard
from kdexp.track import cost, records

log = logging.getLogger("kdexp")

# hook(j) after shard j is finished (its checksum record written). For tests: the resume test kills the build here.
SHARD_END_HOOKS: list[Callable[[int], None]] = []
KEY_FILE = "key.json"  # written when a build starts


def layout_for(cfg, data, teacher=None) -> fmt.Layout:
    """The run's cache layout (fmt.Layout.from_config) over the windows the run's steps read; a hidden store takes
    the `teacher` model's hidden size and params dtype."""
    t = cfg.trainer
    global_batch = t.global_batch_size or t.micro_batch_size * distributed.state().dp_size  # as the trainer reads
    hidden = {}
    if teacher is not None and fmt.Layout.store(cfg) == "hidden":
        dtype = next(teacher.parameters()).dtype
        hidden = {"hidden_size": int(teacher.kdexp_spec.hidden_size),
                  "hidden_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]}
    return fmt.Layout.from_config(cfg, data.vocab_size, data.windows(t.max_steps * global_batch), **hidden)


def cache_key(cfg, data, layout: fmt.Layout, teacher_identity: dict) -> dict:
    """JSON-native: compared entry by entry with a stored manifest's key. ``teacher_identity``: what names the
    teacher's weights (kdexp.train.teacher.teacher_identity: whoever made the teacher knows it). The windows held
    (layout.samples) are not part of it: a cache grows to serve a longer run."""
    return {"format": fmt.FORMAT, "record": layout.record, "teacher": teacher_identity,
            "params_dtype": cfg.model.params_dtype, "precision": cfg.trainer.precision, "data": data.fingerprint,
            "data.seed": int(cfg.data.seed), "train_samples": len(data.train_ds), "seq_length": layout.seq_length,
            "vocab_size": int(data.vocab_size), **layout.key_entries(), "temperatures": list(layout.temperatures),
            "values": layout.values, "shard_samples": layout.shard_samples}


def cache_location(cfg, key: dict) -> Path:
    if cfg.teacher.path is not None:
        return Path(cfg.teacher.path).expanduser()
    return data_cache.cached_path("teacher_cache", key, root=cfg.paths.cache)


def fits(path: Path, j: int, layout: fmt.Layout) -> bool:
    """Shard j's files are intact (their checksum record) and hold exactly the samples `layout` gives the shard: a
    shard written for another sample count (the short last shard of a smaller cache) is never kept."""
    if check_shard(path, j) is not None:
        return False
    n = len(layout.shard_range(j))
    return all(fmt.shard_file(path, j, part).stat().st_size == n * size for part, size in layout.row_bytes().items())


def holds(layout: fmt.Layout, key: dict) -> str:
    """What a cache holds, in words (its manifest's "holds")."""
    data = ", ".join(f"{k} {str(key[k])[:12]}" for k in ("data", "data.seed", "train_samples") if k in key)
    return (f"the teacher's {layout.record} records ({layout.describe()}, temperatures {list(layout.temperatures)}, "
            f"{layout.values} values) of training windows [0, {layout.samples}) ({data}; seq length "
            f"{layout.seq_length}), readable in any order by any trainer.seed, DP size, micro or global batch")


def _agree(flag: bool, group) -> bool:
    """True on every rank of `group` iff it is True on all of them."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], device=distributed.state().device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


@torch.no_grad()
def teacher_record(layout: fmt.Layout, logits: torch.Tensor, sample_ids: range):
    """The record of the samples `sample_ids` from their teacher logits [b, seq, V/tp] (collective over the TP group;
    the same on every TP rank): top-K_max + log-sum-exps, or the draws of each sample from its own seeded stream."""
    temps, tp = list(layout.temperatures), distributed.tp_group()
    if layout.record == "topk":
        return teacher_topk_record(logits, layout.k_max, temps, tp_group=tp)
    per_sample = [draw_teacher(logits[r], samples=layout.draws, proposal_temperature=layout.proposal_temperature,
                               temperatures=temps, seed=fmt.draw_seed(layout.draw_seed, i), tp_group=tp)
                  for r, i in enumerate(sample_ids)]
    return TeacherDraws(*(torch.stack(part) for part in zip(*per_sample)))


@torch.no_grad()
def write_shard(path: Path, j: int, layout: fmt.Layout, teacher, dataset, micro_batch_size: int) -> None:
    """Teacher forward over shard j's samples (collective over the TP group); TP rank 0 writes the files."""
    st = distributed.state()
    writer = st.tp_rank == 0
    rng = layout.shard_range(j)
    shapes = layout.shapes(len(rng))
    tmp = {part: path / f".{fmt.shard_file(path, j, part).name}.tmp-{os.getpid()}" for part in shapes}
    maps = {part: np.memmap(tmp[part], dtype=dt, mode="w+", shape=shape)
            for part, (shape, dt) in shapes.items()} if writer else {}
    for b0 in range(rng.start, rng.stop, micro_batch_size):
        ids = range(b0, min(rng.stop, b0 + micro_batch_size))
        tokens = torch.stack([torch.as_tensor(dataset[i]["tokens"]) for i in ids]).long().to(st.device)
        if layout.record == "hidden":  # after the final norm, before the output layer: [s, b, h] -> [b, s, h]
            rec = models.final_hidden(teacher, tokens)[0].transpose(0, 1)
        else:
            rec = teacher_record(layout, models.vocab_parallel_logits(teacher, tokens), ids)
        if writer:
            o = slice(ids.start - rng.start, ids.stop - rng.start)
            for part, a in fmt.encode_record(layout, rec).items():
                maps[part][o] = a
    if not writer:
        return
    files = {}
    for part, m in maps.items():
        m.flush()
        del m
        final = fmt.shard_file(path, j, part)
        with open(tmp[part], "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp[part], final)
        files[final.name] = {"bytes": final.stat().st_size, "sha256": sha256_file(final)}
    records.write_json(fmt.shard_file(path, j, "json"), {"files": files})  # last: the shard counts as finished


def build(path: Path, key: dict, layout: fmt.Layout, teacher, dataset, micro_batch_size: int,
          known_good: frozenset = frozenset()) -> None:
    """Write every unfinished shard (collective: call on every rank), then global rank 0 writes the manifest.
    `known_good`: shards just verified (not hashed again before the resume decision)."""
    st = distributed.state()
    rank0 = distributed.is_rank0()
    path.mkdir(parents=True, exist_ok=True)
    if rank0:
        for stale in path.glob(".shard-*.tmp-*"):  # a killed build's half-written shard
            stale.unlink(missing_ok=True)
        if not (path / KEY_FILE).is_file():  # first: a resumed build must never keep shards of another key
            records.write_json(path / KEY_FILE, key)
    distributed.barrier()
    problem = fmt.key_mismatch(key, records.read_json(path / KEY_FILE))
    if problem:  # every rank reads the same file: all raise together
        raise CacheMismatch(f"unfinished teacher cache {path} was started for another run ({problem}); point "
                            "teacher.path elsewhere (or null for the default location) or delete it")
    started, kept, written = time.perf_counter(), 0, 0
    for j in range(st.dp_rank, layout.shards, st.dp_size):
        if _agree(j in known_good or fits(path, j, layout), distributed.tp_group()):
            kept += 1
            continue
        write_shard(path, j, layout, teacher, dataset, micro_batch_size)
        written += 1
        if rank0:
            log.info("stage teacher_cache: shard %d/%d written (%.1f s)", j + 1, layout.shards,
                     time.perf_counter() - started)
        for hook in SHARD_END_HOOKS:
            hook(j)
    if rank0 and kept:
        log.info("stage teacher_cache: resumed: kept %d finished shard(s), wrote %d", kept, written)
    distributed.barrier()
    if rank0:
        # what this build pass cost (kdexp.track.cost): a report divides it over the runs that share the cache
        build_cost = cost.build_record(wall_s=time.perf_counter() - started, tokens=layout.samples * layout.seq_length,
                                       shards_written=written, shards_kept=kept, device=st.device)
        shards = {}
        for j in range(layout.shards):
            problem = check_shard(path, j)
            if problem:
                raise RuntimeError(f"teacher cache {path}: after the build {problem}")
            shards[str(j)] = records.read_json(fmt.shard_file(path, j, "json"))
        records.write_json(path / fmt.MANIFEST, {"format": fmt.FORMAT, "holds": holds(layout, key), "key": key,
                                                  "layout": layout.to_json(), "shards": shards, "build": build_cost})
    distributed.barrier()


def _damaged(cache: TeacherCache) -> dict[int, str]:
    """Shard -> what is wrong with it, over every shard of `cache` (collective: each rank hashes its share)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {j: why for j in range(rank, cache.layout.shards, world) if (why := cache.check(j)) is not None}
    if world == 1:
        return mine
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return {j: why for part in every for j, why in part.items()}


def _rebuild(cache: TeacherCache, damaged: dict[int, str], key: dict, teacher, dataset,
             micro_batch_size: int) -> None:
    """Remove the damaged shards (and the manifest: the cache is unfinished until they are back), write them again."""
    path, layout = cache.path, cache.layout
    if distributed.is_rank0():
        for j, why in sorted(damaged.items()):
            log.warning("stage teacher_cache: %s: rebuilding shard %d of %d (the others are intact)", why, j,
                        layout.shards)
        (path / fmt.MANIFEST).unlink(missing_ok=True)
        for j in damaged:
            for part in (*fmt.RECORD_PARTS[layout.record], "json"):
                fmt.shard_file(path, j, part).unlink(missing_ok=True)
    distributed.barrier()
    build(path, key, layout, teacher, dataset, micro_batch_size,
          known_good=frozenset(range(layout.shards)) - frozenset(damaged))


def _extend(cache: TeacherCache, key: dict, layout: fmt.Layout, teacher, dataset, micro_batch_size: int) -> None:
    """Grow `cache` to `layout`'s windows: its intact full shards are kept; the short last one (its sample count
    grows), any damaged one and the new ones are written; the manifest is written again last. Until then the cache
    counts as unfinished, and a killed extension resumes like a killed build."""
    old, path = cache.layout, cache.path
    damaged = _damaged(cache)
    keep = frozenset(j for j in range(old.shards) if len(old.shard_range(j)) == old.shard_samples) - set(damaged)
    if distributed.is_rank0():
        log.info("stage teacher_cache: extending %s from %d to %d windows (keeping %d of its %d shards)", path,
                 old.samples, layout.samples, len(keep), old.shards)
        (path / fmt.MANIFEST).unlink(missing_ok=True)
        for j in set(range(old.shards)) - keep:
            fmt.shard_file(path, j, "json").unlink(missing_ok=True)
    distributed.barrier()
    build(path, key, layout, teacher, dataset, micro_batch_size, known_good=keep)


def ensure(cfg, data, teacher, teacher_identity: dict) -> TeacherCache:
    """The run's teacher cache (built first, under the cache's lock, when missing or unfinished). Every rank.
    ``teacher_identity`` keys the cache by the teacher's weights (see cache_key)."""
    layout = layout_for(cfg, data, teacher)
    key = cache_key(cfg, data, layout, teacher_identity)
    return ensure_at(cache_location(cfg, key), key, layout, teacher, data.train_ds, cfg.trainer.micro_batch_size)


def ensure_at(path: Path, key: dict, layout: fmt.Layout, teacher, dataset, micro_batch_size: int) -> TeacherCache:
    """`ensure` for an explicit location, key and layout (the tests' and tools' entry point)."""
    path = Path(path)
    rank0 = distributed.is_rank0()
    manifest = path / fmt.MANIFEST
    with data_cache.exclusive(path, enabled=rank0):
        done = distributed.rank0_decides(manifest.is_file() if rank0 else True)
        extended = False
        if done:
            cache = TeacherCache(path, key)  # CacheMismatch here names what differs
            started = time.perf_counter()
            if cache.layout.samples < layout.samples:  # a longer run: the missing windows only
                _extend(cache, key, layout, teacher, dataset, micro_batch_size)
                cache, extended = TeacherCache(path, key), True
            damaged = {} if extended else _damaged(cache)
            if damaged:
                _rebuild(cache, damaged, key, teacher, dataset, micro_batch_size)
                cache = TeacherCache(path, key)
            cache.trust(range(cache.layout.shards))  # verified above or written and checked by the rebuild
            if rank0 and not damaged and not extended:
                log.info("stage teacher_cache: reusing %s (%d shard(s) verified in %.2f s; windows [0, %d) of which "
                         "this run reads [0, %d))", path, cache.layout.shards, time.perf_counter() - started,
                         cache.layout.samples, layout.samples)
        else:
            if rank0:
                log.info("stage teacher_cache: one teacher pass over %d samples x %d tokens into %s (%s record: "
                         "%s, temperatures %s, %s values, %d B/token)", layout.samples, layout.seq_length, path,
                         layout.record, layout.describe(), list(layout.temperatures), layout.values,
                         layout.bytes_per_token())
            build(path, key, layout, teacher, dataset, micro_batch_size)
            cache = TeacherCache(path, key)
    distributed.barrier()
    cost.note_cache(path, built=not done or extended)  # the run's cost record names the cache (and its build) it used
    return cache
