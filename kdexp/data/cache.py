"""One cache directory for everything kdexp builds once and reuses (tokenizer, token datasets, teacher).

Every cached artefact is a directory named by what made it:

    path = cached_path("tokenizer", {"vocab_size": 4096, "corpus": fingerprint})
    if not path.exists():
        with atomic_dir(path) as tmp:      # build into tmp; renamed to path on success
            build_into(tmp)

`atomic_dir` makes a half-built cache invisible: the final name appears only through one `os.replace` of a
finished directory. Two processes that race both build; the first rename wins and the loser throws its copy
away, so readers only ever see a complete directory (cache artefacts are deterministic, so either copy is fine).

`builder_barrier` is the distributed half: one process per node builds, everybody waits, then all read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

__all__ = [
    "cache_dir",
    "cache_key",
    "cached_path",
    "atomic_dir",
    "build_cached",
    "file_lock",
    "is_node_builder",
]


def cache_dir() -> Path:
    """The cache root: ``$KDEXP_CACHE`` if set, else ``~/.cache/kdexp``."""
    root = os.environ.get("KDEXP_CACHE") or os.path.join("~", ".cache", "kdexp")
    return Path(root).expanduser().resolve()


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


def build_cached(path: str | os.PathLike, build: Callable[[Path], Any]) -> Path:
    """Return `path`, first calling ``build(tmp_dir)`` inside `atomic_dir(path)` if it does not exist yet."""
    path = Path(path)
    if not path.is_dir():
        with atomic_dir(path) as tmp:
            build(tmp)
    return path


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Exclusive advisory lock (flock) on `path`, for work that cannot be made atomic by a rename.

    Used around megatron's GPTDataset index build, which writes its .npy files in place: without the lock a
    second job could see the files half-written.
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
    """This process's rank on its node (0 when not distributed)."""
    dist = _dist()
    if dist is None:
        return 0
    try:  # the models helper's DistState knows it best (torchrun, SLURM, submitit)
        from kdexp.distributed import state

        return int(state().local_rank)
    except Exception:
        pass
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return dist.get_rank()


def is_node_builder() -> bool:
    """True on the one process per node that builds caches (local rank 0; the only process when not distributed)."""
    return _local_rank() == 0
