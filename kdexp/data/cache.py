"""One cache directory for everything kdexp builds once and reuses (tokenizer, token datasets, teacher).

Every cached artefact is a directory named by what made it, built through one call:

    path = cached_path("tokenizer", {"vocab_size": 4096, "corpus": fingerprint})
    build_cached(path, lambda tmp: build_into(tmp))    # returns path, intact

Three guarantees, each in one helper:
  * atomic: `atomic_dir` builds into a temporary directory and renames it into place, so a half-built artefact
    is never visible under its final name;
  * verified: the last file written into an artefact is its manifest (kdexp_manifest.json: size and sha256 of
    every other file, itself written atomically). `check` verifies it before use; a missing, truncated or
    garbled file is named in a warning and the artefact is discarded and rebuilt, never used;
  * one builder: `exclusive` holds an flock on ``.<name>.lock`` next to the artefact around check-build-save, so
    parallel jobs on a cold cache build once: the others wait, then find it intact and reuse it.

The distributed half (one process per node builds, everybody waits at a barrier, then all read) is the caller's:
`is_node_builder` says who builds; kdexp.distributed.barrier / rank0_decides keep the ranks in step.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from kdexp import cache_dir
from kdexp.track import records

__all__ = [
    "MANIFEST",
    "cache_dir",
    "cache_key",
    "cached_path",
    "atomic_dir",
    "build_cached",
    "check",
    "exclusive",
    "file_lock",
    "is_node_builder",
    "sha256_file",
    "verify",
    "write_manifest",
]

log = logging.getLogger(__name__)

MANIFEST = "kdexp_manifest.json"


def cache_key(key_dict: Mapping[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of `key_dict` (sorted keys; non-JSON values via str())."""
    blob = json.dumps(dict(key_dict), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def cached_path(kind: str, key_dict: Mapping[str, Any], root: str | os.PathLike | None = None) -> Path:
    """``<root>/<kind>/<sha256(key_dict)[:20]>``: where the artefact that `key_dict` describes lives.

    `root` defaults to `cache_dir()`. Nothing is created; combine with `atomic_dir` / `build_cached`.
    """
    if not kind or "/" in kind or kind.startswith("."):
        raise ValueError(f"kind must be a plain directory name, got {kind!r}")
    base = Path(root).expanduser() if root is not None else cache_dir()
    return base / kind / cache_key(key_dict)[:20]


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `path`; on normal exit rename it to `path`.

    If `path` appeared meanwhile (another process won the race) the temporary copy is deleted and `path`
    is left untouched. On an exception the temporary directory is deleted and the exception propagates.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same parent => same filesystem => os.replace is an atomic rename.
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        # Renaming onto a non-empty directory fails (ENOTEMPTY/EEXIST); onto a missing one it succeeds.
        os.replace(tmp, path)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not path.is_dir():
            raise
        # Lost the race: the winner's copy is complete, keep it.


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: str | os.PathLike) -> dict:
    """Record size + sha256 of every file under `directory` in its manifest (atomically); call it last."""
    directory = Path(directory)
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[file.relative_to(directory).as_posix()] = {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
    if not files:
        raise ValueError(f"{directory}: nothing to cache (the build wrote no file)")
    manifest = {"format": 1, "files": files}
    records.write_json(directory / MANIFEST, manifest)
    return manifest


def verify(directory: str | os.PathLike) -> Optional[str]:
    """None when every file of `directory` matches its manifest, else why not, naming the file."""
    directory = Path(directory)
    if not directory.is_dir():
        return f"{directory} does not exist"
    manifest = records.read_json(directory / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{directory / MANIFEST} is missing or unreadable (the build did not complete)"
    for name, want in sorted(files.items()):
        file = directory / name
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if size != want.get("bytes"):
            return f"{file} is {size} bytes, the manifest says {want.get('bytes')} (truncated or overwritten)"
        digest = sha256_file(file)
        if digest != want.get("sha256"):
            return f"{file} fails its checksum (sha256 {digest[:12]}..., manifest {str(want.get('sha256'))[:12]}...)"
    return None


def _discard(path: Path) -> None:
    """Move `path` out of the way (one rename, so nobody sees it half-deleted), then delete it."""
    aside = path.parent / f".{path.name}.corrupt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def check(path: str | os.PathLike) -> bool:
    """True when the artefact at `path` is intact; False when it must be built: missing, or corrupt (then a
    warning names the bad file and the artefact is discarded). Call it under `exclusive(path)`."""
    path = Path(path)
    if not path.exists():
        return False
    problem = verify(path)
    if problem is None:
        return True
    log.warning("cache: %s; discarding %s and rebuilding it", problem, path)
    _discard(path)
    return False


def build_cached(path: str | os.PathLike, build: Callable[[Path], Any]) -> Path:
    """Return `path`, intact: when it is missing or fails `check`, ``build(tmp_dir)`` then `write_manifest`
    inside `atomic_dir(path)`; all of it under `exclusive(path)`, so concurrent callers build once."""
    path = Path(path)
    with exclusive(path):
        if not check(path):
            with atomic_dir(path) as tmp:
                build(tmp)
                write_manifest(tmp)
    return path


def lock_file(path: str | os.PathLike) -> Path:
    """The lock file of the artefact at `path`: ``.<name>.lock`` beside it (kept; an flock dies with its holder)."""
    path = Path(path)
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def exclusive(path: str | os.PathLike, *, enabled: bool = True) -> Iterator[None]:
    """Hold the artefact's lock (see `lock_file`) for check-build-save; `enabled=False` is a no-op, for the ranks
    that wait on their own rank 0 instead."""
    if not enabled:
        yield
        return
    with file_lock(lock_file(path)):
        yield


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Exclusive advisory lock (flock) on `path`, for work that cannot be made atomic by a rename.

    Used by `exclusive`, and around megatron's GPTDataset index build, which writes its .npy files in place:
    without the lock a second job could see the files half-written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _local_rank() -> int:
    """This process's rank on its node (0 when not distributed): the launcher's answer (kdexp.distributed.launch)."""
    if _dist() is None:
        return 0
    from kdexp.distributed import launch

    return launch.local_rank()


def is_node_builder() -> bool:
    """True on the one process per node that builds caches (local rank 0; the only process when not distributed)."""
    return _local_rank() == 0
