"""kdexp.data.cache: manifests (a corrupt cached artefact is named, discarded and rebuilt, identically) and the build
lock (parallel jobs on a cold cache build once and share the result).

Every kind of cached artefact is corrupted the way disks and killed jobs do it (truncated, garbled in place with the
same size, deleted, manifest lost): the tokenizer (tokenizer.json, kdexp_tokenizer.json), the token shards (.bin,
.idx) and the embedded teacher (model.safetensors, config.json). References: sha256 of the original build, computed
here with hashlib, and the build functions' own log lines as build counters.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdexp.data import cache
from kdexp.distributed.testing import free_port
from kdexp.track.cost import ONE_TIME_RECORD
from _cache_worker import digests, prepare_and_teacher, tiny_cfg

WORKER = str(Path(__file__).with_name("_cache_worker.py"))
ROOT = str(Path(__file__).resolve().parents[1])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garble(path: Path) -> None:
    """Same size, one byte changed in the middle: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def delete(path: Path) -> None:
    path.unlink()


# -------------------------------------------------------------------------------------------- the cache API

def test_build_cached_writes_manifest_then_verifies_and_rebuilds(tmp_path, caplog):
    path = cache.cached_path("thing", {"n": 1}, root=tmp_path)
    builds = []

    def build(tmp: Path) -> None:
        builds.append(1)
        (tmp / "a.txt").write_text("alpha\n")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(bytes(range(256)))

    assert cache.build_cached(path, build) == path and len(builds) == 1
    manifest = json.loads((path / cache.MANIFEST).read_text())
    assert manifest["files"] == {  # independent reference: sizes and hashlib digests of what build wrote
        "a.txt": {"bytes": 6, "sha256": hashlib.sha256(b"alpha\n").hexdigest()},
        "sub/b.bin": {"bytes": 256, "sha256": hashlib.sha256(bytes(range(256))).hexdigest()}}
    assert cache.verify(path) is None
    cache.build_cached(path, build)
    assert len(builds) == 1  # intact: reused
    for corrupt, file, words in ((garble, "sub/b.bin", "checksum"), (truncate, "a.txt", "truncated"),
                                 (delete, "sub/b.bin", "missing"), (delete, cache.MANIFEST, "did not complete")):
        corrupt(path / file)
        assert file in cache.verify(path) and words in cache.verify(path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kdexp"):
            cache.build_cached(path, build)
        assert str(path / file) in caplog.text and "rebuilding" in caplog.text
        assert cache.verify(path) is None and (path / "a.txt").read_text() == "alpha\n"
        assert json.loads((path / cache.MANIFEST).read_text()) == manifest
    assert len(builds) == 5
    # nothing left behind but the artefact and its lock file (no temporary or discarded copies)
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, f".{path.name}.lock"])


def test_failed_build_leaves_nothing_and_no_manifest_no_trust(tmp_path):
    path = cache.cached_path("thing", {"n": 2}, root=tmp_path)

    def crash(tmp: Path) -> None:
        (tmp / "x").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.build_cached(path, crash)
    assert not path.exists()
    path.mkdir(parents=True)  # e.g. a cache written before manifests existed: rebuilt, never trusted
    (path / "x").write_text("old")
    assert cache.check(path) is False and not path.exists()
    with pytest.raises(ValueError, match="no file"):
        cache.build_cached(path, lambda tmp: None)


# ----------------------------------------------------------------------------- data and teacher, in process

@pytest.fixture(scope="module")
def dist_cpu():
    from kdexp import distributed

    distributed.initialize(seed=3)
    yield
    distributed.destroy()


# What a build cost (build.json: its wall time) differs between two builds of the same weights, and so does the
# manifest that seals it; every other file of a rebuild is compared byte for byte.
UNREPEATABLE = (cache.MANIFEST, ONE_TIME_RECORD)


@pytest.fixture(scope="module")
def cold(tmp_path_factory, dist_cpu):
    """One cold build of tokenizer, token shards and teacher; each case corrupts its own copy of it."""
    root = tmp_path_factory.mktemp("cold")
    data, teacher_dir = prepare_and_teacher(tiny_cfg(root))
    dirs = {"tokenizer": Path(data.info["tokenizer"]), "tokens": Path(data.info["tokens"]), "teacher": teacher_dir}
    files = {f"{kind}/{p.relative_to(d)}": _sha(p) for kind, d in dirs.items() for p in d.rglob("*")
             if p.is_file() and p.name not in UNREPEATABLE}
    return root, dirs, files


CASES = [
    ("tokenizer", "tokenizer.json", truncate, "training a"),
    ("tokenizer", "kdexp_tokenizer.json", garble, "training a"),
    ("tokens", "train.bin", garble, "tokenizing"),
    ("tokens", "val.idx", truncate, "tokenizing"),
    ("tokens", "train.idx", delete, "tokenizing"),
    ("teacher", "model.safetensors", truncate, "stage teacher"),
    ("teacher", "config.json", garble, "stage teacher"),
    ("teacher", cache.MANIFEST, delete, "stage teacher"),  # a save killed before its manifest
]


@pytest.mark.parametrize("kind,name,corrupt,build_line", CASES, ids=[f"{c[2].__name__}-{c[1]}" for c in CASES])
def test_corrupt_artefact_is_named_and_rebuilt_identically(cold, tmp_path, caplog, kind, name, corrupt, build_line):
    root, dirs, files = cold
    mine = tmp_path / "cache"
    shutil.copytree(root, mine)
    target = mine / dirs[kind].relative_to(root) / name
    corrupt(target)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kdexp"):
        data, teacher_dir = prepare_and_teacher(tiny_cfg(mine))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(target) in w and "rebuilding" in w for w in warnings), warnings
    # only the corrupt artefact was built again
    lines = caplog.text
    for other in ("training a", "tokenizing", "stage teacher"):
        assert (other in lines) == (other == build_line), (other, lines)
    again = {"tokenizer": Path(data.info["tokenizer"]), "tokens": Path(data.info["tokens"]), "teacher": teacher_dir}
    assert {k: d.relative_to(mine) for k, d in again.items()} == {k: d.relative_to(root) for k, d in dirs.items()}
    rebuilt = {f"{k}/{p.relative_to(d)}": _sha(p) for k, d in again.items() for p in d.rglob("*")
               if p.is_file() and p.name not in UNREPEATABLE}
    assert (teacher_dir / ONE_TIME_RECORD).is_file()  # what this build cost, beside what it built
    assert rebuilt == files  # deterministic builds: the rebuilt artefact is byte-identical to the original
    assert all(cache.verify(d) is None for d in again.values())


# ------------------------------------------------------------------------------------------------- the lock

def _start_workers(n: int, cache_dir: Path, tmp_path: Path, env: dict):
    go = tmp_path / "go"
    procs = []
    for i in range(n):
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, str(cache_dir), str(go), str(tmp_path / f"out{i}.json")], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    time.sleep(0.5)
    go.write_text("go")
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    return [err for _, err in results]


@pytest.mark.slow
def test_parallel_jobs_on_cold_cache_build_once_and_share(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    logs = _start_workers(2, tmp_path / "cache", tmp_path, env)
    joined = "\n".join(logs)
    # one builder per artefact: the other job waited on the lock, then found it intact and reused it
    assert joined.count("training a 512-token byte-level BPE") == 1, joined[-3000:]
    assert joined.count("tokenizing") == 1
    assert joined.count("stage teacher: pretraining") == 1
    assert "rebuilding" not in joined  # the waiter never saw a half-built artefact
    out = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert out[0] == out[1] and any(k.startswith("teacher/") for k in out[0])
    assert out[0] == digests(*[d for d in (tmp_path / "cache").glob("*/*") if d.is_dir() and d.parent.name in
                               ("tokenizer", "stdlib_tokens", "teacher")])


@pytest.mark.slow
def test_two_rank_job_rebuilds_corrupt_teacher_together(tmp_path):
    """Data-parallel job (2 ranks): rank 0 holds the lock and decides, both ranks pretrain (collectives in step),
    rank 0 writes; a corrupt teacher found by rank 0 is rebuilt by both, byte-identical."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    (tmp_path / "go").write_text("go")

    def job(tag: str) -> str:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), WORKER, str(tmp_path / "cache"), str(tmp_path / "go"),
               str(tmp_path / f"{tag}{{rank}}.json")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stderr

    first = job("cold")
    assert first.count("stage teacher: pretraining") == 1  # rank 0 says it; rank 1 trained with it (dp_size 2)
    cold = [json.loads((tmp_path / f"cold{r}.json").read_text()) for r in (0, 1)]
    assert cold[0] == cold[1]
    (teacher_dir,) = [d for d in (tmp_path / "cache" / "teacher").iterdir() if d.is_dir()]
    truncate(teacher_dir / "model.safetensors")
    second = job("again")
    assert str(teacher_dir / "model.safetensors") in second and "rebuilding" in second
    assert second.count("stage teacher: pretraining") == 1 and "training a" not in second
    again = [json.loads((tmp_path / f"again{r}.json").read_text()) for r in (0, 1)]
    assert again[0] == again[1] == cold[0]


