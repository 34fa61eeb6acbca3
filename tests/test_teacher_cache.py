"""kdexp.teacher: the offline teacher cache's format, writer and reader on a fake teacher (no megatron model).

Read back = what teacher_topk_record computes from the same logits (fp32 bit-exact, compact to its dtype); index
packing in 1-4 bytes; bytes on disk = the layout's bytes/token (top-K and sampled records); a garbled or truncated
shard is named by its checksum; a cache (finished or not) of another key is refused naming what differs; a build
killed by SIGKILL mid-way resumes keeping its finished shards and ends identical to an uninterrupted build; two
concurrent jobs build once. The machinery cases run for both record types; what a sampled record holds and trains is
tests/test_teacher_cache_sampled.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import _teacher_cache_worker as w
from _launch import kdexp_run
from _lone_process import lone_process
from kdexp.losses import teacher_topk_record
from kdexp.teacher import CacheCorrupt, CacheMismatch, TeacherCache
from kdexp.teacher import format as fmt

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_teacher_cache_worker.py")


SAMPLED = dict(draws=8, proposal_temperature=1.0)  # the fake teacher's "sampled" layout in the record-type cases


def _build(path, values="float32", layout=None, micro_batch_size=2, **key_changes):
    from kdexp.teacher.writer import ensure_at

    lay = layout or w.layout(values)
    with lone_process(seed=0):
        return ensure_at(path, w.key(lay, **key_changes), lay, w.FakeTeacher(), w.dataset(), micro_batch_size)


def _layout(record):
    return w.layout() if record == "topk" else w.layout(**SAMPLED)


def _expected(samples, temp_index):
    ds, teacher = w.dataset(), w.FakeTeacher()
    ids = torch.stack([ds[i]["tokens"] for i in samples])
    logits = teacher(ids, torch.arange(w.SEQ).expand_as(ids), None)
    rec = teacher_topk_record(logits, w.K_MAX, w.TEMPS)
    return rec.values, rec.indices, rec.lse[..., temp_index], rec.lse_rest[..., temp_index]


@pytest.mark.parametrize("values", ["float32", "bfloat16"])
def test_read_back_is_the_record(tmp_path, values):
    cache = _build(tmp_path / "c", values)
    samples = [7, 0, 9, 3]  # across shards, the short last one included
    for ti, temp in enumerate(w.TEMPS):
        got = cache.read(torch.tensor(samples), temp)
        want = list(_expected(samples, ti))
        if values == "bfloat16":
            want[0] = want[0].to(torch.bfloat16).float()
        for name, a, b in zip(("values", "indices", "lse", "lse_rest"), got, want):
            assert torch.equal(a, b), name  # bit-exact: lse's are stored in float32 whatever the value dtype
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert "manifest.json" in files and "shard-00003.values" in files and not any(".tmp-" in f for f in files)
    data = sum((tmp_path / "c" / f).stat().st_size for f in files if f.split(".")[-1] in ("values", "indices", "lse"))
    assert data == w.SAMPLES * w.SEQ * cache.layout.bytes_per_token()
    with pytest.raises(ValueError, match=r"loss.temperature=3.0 is invalid: .* holds temperatures \[1.0, 2.0\]"):
        cache.read([0], 3.0)
    with pytest.raises(IndexError, match=r"outside the teacher cache's windows \[0, 10\)"):
        cache.read([10], 1.0)


@pytest.mark.parametrize("vocab,nb", [(256, 1), (300, 2), (65536, 2), (65537, 3), (151936, 3), (2**24 + 1, 4)])
def test_indices_pack_in_the_fewest_bytes(vocab, nb):
    assert fmt.index_bytes(vocab) == nb
    ids = torch.tensor([[[0, 1, vocab - 1, vocab // 2, 255 % vocab]]])
    packed = fmt.encode_indices(ids, nb)
    assert packed.dtype.itemsize * packed.shape[-1] == nb * ids.shape[-1]
    assert torch.equal(fmt.decode_indices(packed, nb), ids)


def test_bytes_per_token_qwen3():
    """Qwen3's 151,936-entry vocabulary needs 3-byte ids: K=1024 -> 7176 B (fp32) / 5128 B (bf16) per token."""
    lay = fmt.Layout(1, 1, 1024, (1.0,), "float32", fmt.index_bytes(151936), 1)
    assert lay.bytes_per_token() == 1024 * (4 + 3) + 8
    assert fmt.Layout(1, 1, 1024, (1.0,), "bfloat16", 3, 1).bytes_per_token() == 1024 * (2 + 3) + 8


@pytest.mark.parametrize("vocab,values,topk,sampled", [
    (2048, "float32", 6152, 456), (2048, "bfloat16", 4104, 328), (151936, "float32", 7176, 520),
    (151936, "bfloat16", 5128, 392)])
def test_bytes_per_token_sampled_vs_topk(vocab, values, topk, sampled):
    """At the defaults (teacher.k_max 1024, loss=sampled's 64 draws, one temperature): a sampled record is 64 x (value
    + id + a 1-byte count) + 4 (T + 1) bytes, ~13x smaller than top-1024's."""
    nb = fmt.index_bytes(vocab)
    assert fmt.Layout(1, 1, 1024, (1.0,), values, nb, 1).bytes_per_token() == topk
    lay = fmt.Layout(1, 1, 0, (1.0,), values, nb, 1, record="sampled", draws=64, proposal_temperature=1.0,
                     draw_seed=0)
    assert lay.bytes_per_token() == sampled == 64 * ({"float32": 4, "bfloat16": 2}[values] + nb + 1) + 8
    assert [fmt.count_bytes(n) for n in (1, 255, 256, 65535, 65536)] == [1, 1, 2, 2, 4]
    with pytest.raises(ValueError, match="record='dense' is not a teacher-cache record type"):
        fmt.Layout(1, 1, 0, (1.0,), values, nb, 1, record="dense")


@pytest.mark.parametrize("record,part", [("topk", "values"), ("sampled", "counts")])
def test_corruption_is_named(tmp_path, record, part):
    path = tmp_path / "c"
    _build(path, layout=_layout(record))
    f = path / f"shard-00001.{part}"
    raw = bytearray(f.read_bytes())
    raw[17] ^= 0xFF
    f.write_bytes(bytes(raw))
    with open(path / "shard-00002.lse", "r+b") as h:
        h.truncate(40)
    cache = TeacherCache(path)
    cache.read([0, 1], 1.0)  # shard 0 is intact
    with pytest.raises(CacheCorrupt, match=rf"shard-00001.{part} fails its checksum"):
        cache.read([4], 1.0)
    with pytest.raises(CacheCorrupt, match=r"shard-00002.lse is 40 bytes, its checksum record says \d+ "):
        cache.read([6], 1.0)
    with pytest.raises(CacheCorrupt, match=f"shard-00001.{part}"):
        TeacherCache(path).verify()
    (path / "manifest.json").unlink()
    with pytest.raises(CacheCorrupt, match="unfinished"):
        TeacherCache(path)


def test_damaged_shards_are_found_before_use_and_only_they_are_rebuilt(tmp_path, caplog):
    """A flipped byte, a truncated file and a deleted shard (what the old message told users to do): the next open
    through ensure (what a run does before its first step) names each and rewrites those shards only."""
    path = tmp_path / "c"
    _build(path)
    fresh = _shard_digests(path)
    kept = {p.name: p.stat().st_mtime_ns for p in path.glob("shard-00000.*")}
    f = path / "shard-00001.values"
    raw = bytearray(f.read_bytes())
    raw[17] ^= 0xFF
    f.write_bytes(bytes(raw))
    with open(path / "shard-00002.lse", "r+b") as h:
        h.truncate(40)
    for p in path.glob("shard-00003.*"):
        p.unlink()
    with caplog.at_level("WARNING", logger="kdexp"):
        cache = _build(path)
    said = [r.getMessage() for r in caplog.records if "rebuilding shard" in r.getMessage()]
    assert len(said) == 3, said
    assert "shard-00001.values fails its checksum" in said[0] and "rebuilding shard 1 of 4" in said[0]
    assert "shard-00002.lse is 40 bytes" in said[1] and "shard-00003.indices is missing" in said[2]
    assert {p.name: p.stat().st_mtime_ns for p in path.glob("shard-00000.*")} == kept  # untouched
    assert _shard_digests(path) == fresh and (path / "manifest.json").is_file()
    TeacherCache(path).verify()
    cache.read([0, 4, 6, 7], 1.0)


def test_the_fix_printed_for_a_shard_damaged_after_open_works(tmp_path):
    path = tmp_path / "c"
    _build(path)
    fresh = _shard_digests(path)
    with open(path / "shard-00002.values", "r+b") as h:
        h.truncate(8)
    with pytest.raises(CacheCorrupt, match="rerun: a run checks every shard of its teacher cache before training "
                                           "and rebuilds the damaged ones") as err:
        TeacherCache(path).read([6], 1.0)  # shard 2 (3 samples per shard)
    assert "shard-00002.values is 8 bytes" in str(err.value)
    _build(path)  # the rerun
    assert _shard_digests(path) == fresh


def test_another_key_is_refused_naming_what_differs(tmp_path):
    path = tmp_path / "c"
    _build(path)
    lay = w.layout()
    with pytest.raises(CacheMismatch, match=r"k_max: cache 12, this run 16"):
        TeacherCache(path, w.key(lay, k_max=16))
    with pytest.raises(CacheMismatch, match=r"teacher: cache 'fake', this run 'other'"):
        _build(path, teacher="other")
    with pytest.raises(CacheMismatch, match=r"data.seed: cache 1234, this run 7"):
        _build(path, **{"data.seed": 7})
    (path / "manifest.json").unlink()  # unfinished: its shards must not be resumed for another key either
    with pytest.raises(CacheMismatch, match=r"unfinished .* \(teacher: cache 'fake', this run 'third'\)"):
        _build(path, teacher="third")


@pytest.mark.parametrize("record", ["topk", "sampled"])
def test_a_longer_run_extends_the_cache_and_a_shorter_one_reads_its_prefix(tmp_path, caplog, record):
    """Indexed by sample: a run that reads 7 windows builds shards 0, 1 and a short shard 2; one that reads all 10
    keeps shards 0 and 1 as they are (same files), writes shard 2 again and the new shard 3, and ends byte for byte
    equal to a cache built for 10 at once; one that reads 5 afterwards builds nothing and reads the prefix."""
    full = _layout(record)
    short = full.grown(7)
    path = tmp_path / "c"
    _build(path, layout=short)
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.glob("shard-0000[01].*")}
    with caplog.at_level("INFO", logger="kdexp"):
        cache = _build(path, layout=full)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "extending" in said and "from 7 to 10 windows (keeping 2 of its 3 shards)" in said, said
    assert "shard 1/4 written" not in said and "shard 3/4 written" in said and "shard 4/4 written" in said
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.glob("shard-0000[01].*")} == kept
    assert cache.layout.samples == 10 and "training windows [0, 10)" in fmt_manifest(path)["holds"]
    fresh = _build(tmp_path / "fresh", layout=full)
    assert _shard_digests(path) == _shard_digests(fresh.path)
    caplog.clear()
    with caplog.at_level("INFO", logger="kdexp"):
        again = _build(path, layout=full.grown(5))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "reusing" in said and "windows [0, 10) of which this run reads [0, 5)" in said and "written" not in said
    got, want = again.read([4, 0, 9], 1.0), fresh.read([4, 0, 9], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def fmt_manifest(path):
    import json

    return json.loads((Path(path) / fmt.MANIFEST).read_text())


def test_a_cache_of_another_format_is_refused_naming_it(tmp_path):
    import json

    path = tmp_path / "c"
    _build(path)
    manifest = fmt_manifest(path)
    (path / fmt.MANIFEST).write_text(json.dumps({**manifest, "format": 2}))
    with pytest.raises(CacheMismatch, match=r"is of format 2, this kdexp reads format 3 \(records indexed by "
                                            r"training window\)"):
        TeacherCache(path)


def _worker(path, *args, check=True):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(WORKER.parent)]), "OMP_NUM_THREADS": "1"}
    return kdexp_run([str(path), *args], env, entry=str(WORKER), check=check, timeout=300)


def _shard_digests(path):
    return {p.name: p.read_bytes() for p in sorted(Path(path).glob("shard-*")) if p.suffix != ".json"}


@pytest.mark.slow
@pytest.mark.parametrize("record", ["topk", "sampled"])
def test_sigkill_mid_build_resumes_keeping_finished_shards(tmp_path, record):
    extra = () if record == "topk" else ("--draws", str(SAMPLED["draws"]))
    killed = _worker(tmp_path / "c", "--kill-after", "1", *extra, check=False)
    assert killed.returncode == -9, killed.stderr
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert (tmp_path / "c" / "shard-00001.json").exists() and not (tmp_path / "c" / "shard-00002.json").exists()
    resumed = _worker(tmp_path / "c", *extra)
    assert "kept 2 finished shard(s), wrote 2" in resumed.stderr, resumed.stderr
    assert "shard 1/4 written" not in resumed.stderr and "shard 3/4 written" in resumed.stderr
    fresh = _build(tmp_path / "fresh", layout=_layout(record))
    assert _shard_digests(tmp_path / "c") == _shard_digests(fresh.path)
    TeacherCache(tmp_path / "c").verify()


@pytest.mark.slow
def test_concurrent_jobs_build_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(WORKER.parent)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(WORKER), str(tmp_path / "c"), "--slow", "0.3"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".c.lock")) and time.monotonic() < deadline:  # the first one holds the lock
        time.sleep(0.1)
    second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=300) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outs
    logs = [err for _, err in outs]
    assert sum("one teacher pass" in e for e in logs) == 1, logs
    assert sum("stage teacher_cache: reusing" in e for e in logs) == 1, logs
    assert all("shards=4" in out for out, _ in outs)
    TeacherCache(tmp_path / "c").verify()


def test_layout_shapes_cover_the_samples():
    lay = w.layout()
    assert lay.shards == 4 and list(lay.shard_range(3)) == [9]
    shape, dt = lay.shapes(3)["indices"]
    assert shape == (3, w.SEQ, w.K_MAX) and dt == np.dtype("<u2")


def _parallel_build(rank, world, root, tp, record):
    """tp=2: TP ranks gather the vocab-parallel top-K (or make the draws together), TP rank 0 writes; tp=1: DP=2,
    shards split over DP ranks."""
    import kdexp.distributed as kd
    from kdexp.teacher.writer import ensure_at

    lay = _layout(record)
    kd.initialize(tensor_parallel=tp, seed=0)
    cache = ensure_at(Path(root), w.key(lay), lay, w.FakeTeacher(), w.dataset(), 2)
    return cache.read(list(range(w.SAMPLES)), 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("record", ["topk", "sampled"])
def test_tp2_and_dp2_builds_equal_the_single_process_build(tmp_path, record):
    from kdexp.distributed.testing import run_on_processes

    one = _build(tmp_path / "one", layout=_layout(record)).read(list(range(w.SAMPLES)), 2.0)
    for tp in (2, 1):
        for built in run_on_processes(_parallel_build, 2, args=(str(tmp_path / f"tp{tp}"), tp, record), timeout=600):
            assert torch.equal(built[1], one[1])  # the same top-K ids (sampled: the same counts)
            if record == "sampled":
                assert torch.equal(built.ids, one.ids) and torch.equal(built.counts, one.counts)
            for a, b in zip(built, one):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    dp2 = sorted(p.name for p in (tmp_path / "tp1").glob("shard-*.json"))
    assert dp2 == [f"shard-{j:05d}.json" for j in range(4)]


@pytest.mark.parametrize("values", ["float32", "bfloat16"])
def test_the_whole_cache_is_checked_for_a_nucleus_that_overflows(tmp_path, values):
    """kdexp.teacher.reader.check_nucleus, run before training: over every shard, the same count and K_max bound the
    per-batch rule (check_nucleus_fits) gives on all the cache's tokens at once; none when every nucleus fits."""
    from kdexp.losses.cached import check_nucleus_fits
    from kdexp.rules import ConfigError
    from kdexp.teacher.reader import check_nucleus

    cache = _build(tmp_path / "c", values)
    n = w.SAMPLES * w.SEQ
    for ti, temp in enumerate(w.TEMPS):
        vals, _, lse, rest = (x.flatten(0, 1) for x in cache.read(list(range(w.SAMPLES)), temp))
        mass = -torch.expm1(rest.double() - lse.double())  # an independent reading of the cached mass
        top_p = float(mass.median())  # about half the tokens overflow, spread over every shard
        over = int((mass < top_p).sum())
        assert 0 < over < n
        with pytest.raises(ValueError, match=r"teacher.k_max >= (\d+)") as per_batch:
            check_nucleus_fits(vals, lse, rest, top_p, temp, w.VOCAB)
        bound = per_batch.value.args[0].split("teacher.k_max >= ")[1].split()[0]
        with pytest.raises(ConfigError) as err:
            check_nucleus(cache, top_p=top_p, temperature=temp, vocab=w.VOCAB)
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"loss.top_p={top_p} does not fit in the teacher cache's top-12 "
                                                    f"(teacher.k_max=12) for {over} of its {n} tokens")
        assert f"build the cache with teacher.k_max >= {bound} (a lower bound)" in line
        assert check_nucleus(cache, top_p=float(mass.min()) * 0.999, temperature=temp, vocab=w.VOCAB) == n
