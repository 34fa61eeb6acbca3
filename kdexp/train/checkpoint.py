"""Checkpoint / resume of the student: model shard, optimizer, step, data position, RNG, interval accumulators.

Layout: ``checkpoints/step_<N>/tp<r>.pt`` (one file per TP rank; data-parallel replicas are identical, so only DP
rank 0 writes), beside it ``tp<r>.json`` = {"file", "bytes", "sha256", "step"}, and ``checkpoints/latest`` holding N.

Writing: every TP rank writes ``tp<r>.pt`` through a temp file + fsync + os.replace, then its manifest the same way
(the manifest is the commit mark of its file), then global rank 0 replaces ``latest`` and rotates. After each of the
two parts the ranks agree on the outcome (one int all-reduce, in place of a barrier): a write that fails on one rank
(a full disk on one node) makes every rank raise that rank's error, so no rank waits for it forever and rank 0 names
the path and the cause (kdexp.track.faults). A run killed at any moment leaves either a complete step or a file
without a manifest (never trusted).

Reading: candidates are ``latest`` and then every older step dir, newest first (all step dirs when ``latest`` is
missing or garbage, with a warning). A step dir without any manifest that ``latest`` does not name is a save killed
before it committed anything and is ignored (so a run killed in its first save starts over instead of failing
forever). Every rank verifies and loads its own file; the ranks agree on the first candidate that is intact on all
of them, so a torn or corrupt latest falls back to the previous intact step with a warning that names the bad file,
and under TP no two ranks load different steps. Never a silent restart from 0: a ``latest`` pointer with no step
left on disk, or only corrupt steps, is an error that names the files.

Nothing read back runs code: a file is loaded with ``torch.load(weights_only=True)`` (torch's restricted unpickler:
tensors, dtypes, sizes and plain containers and numbers only), and ``save`` refuses a state holding anything else, so
every checkpoint it writes loads that way. A file that asks the unpickler for anything else (a crafted pickle whose
``__reduce__`` calls a function) is refused before any of it runs; that is an error naming the file, never a
fallback to an older step, since the run dir has been tampered with. The sha256 manifest guards against torn and
damaged files, not against a crafted file with a matching manifest: the unpickler does.

Rotation keeps the step just written and the newest ``keep - 1`` complete steps before it; step dirs after it are
from an abandoned timeline (another config, or a corrupt step this run fell back from) and are removed.
"""
from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from kdexp import distributed
from kdexp.data.cache import sha256_file
from kdexp.track import faults, records

log = logging.getLogger("kdexp")


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step}"


def steps_on_disk(ckpt_dir: Path) -> list[int]:
    """Step numbers of the step_<N> directories, ascending."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in ckpt_dir.glob("step_*") if p.name[5:].isdigit() and p.is_dir())


def latest_step(ckpt_dir: Path) -> Optional[int]:
    """The step ``latest`` points at, or None when it is missing or not a step number."""
    try:
        return int((Path(ckpt_dir) / "latest").read_text().strip())
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None


def _atomic_write(path: Path, write) -> None:
    """write(f) into a temp file beside `path`, fsync, os.replace; a failed write leaves neither file behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save through a temp file and os.replace; every checkpoint file is written here (so a fault test can put
    a full disk in its place)."""
    _atomic_write(path, lambda f: torch.save(obj, f))


# What torch.load(weights_only=True) rebuilds (torch._weights_only_unpickler's allowed globals), checked by exact type
# for containers: a dict subclass (defaultdict) or any other object would make the file unloadable.
_LEAVES = (str, bytes, int, float, bool, complex, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)
_CONTAINERS = (dict, OrderedDict, list, tuple)


def check_plain(obj: Any, where: str = "state") -> None:
    """TypeError naming the first entry of a checkpoint state that is not a tensor or a plain value: it would not
    load with weights_only=True. A bug in the state_dict that produced it, caught at the save, not at a resume."""
    if type(obj) in _CONTAINERS:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            if isinstance(obj, dict) and not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint {where} has a key {k!r} of type {type(k).__qualname__}: a checkpoint "
                                "holds only str/int keys (it loads with torch.load(weights_only=True))")
            check_plain(v, f"{where}[{k!r}]")
    elif not isinstance(obj, _LEAVES):
        raise TypeError(f"checkpoint {where} is a {type(obj).__module__}.{type(obj).__qualname__}: a checkpoint holds "
                        "only tensors and plain values (it loads with torch.load(weights_only=True)); convert it in "
                        "the state_dict that produced it")


class UnsafeCheckpoint(faults.DamagedFile):
    """A checkpoint file that asks the unpickler for more than tensors and plain values: refused, never run."""


def _manifest(path: Path) -> Path:
    return path.with_suffix(".json")


def write_file(path: Path, state: dict[str, Any], step: int) -> None:
    """One checkpoint file and then its manifest, both atomically."""
    atomic_torch_save(state, path)
    records.write_json(_manifest(path), {"file": path.name, "bytes": path.stat().st_size,
                                         "sha256": sha256_file(path), "step": step})


def verify(path: Path) -> Optional[str]:
    """None when `path` matches its manifest, else why it does not (missing, torn, checksum mismatch)."""
    manifest = records.read_json(_manifest(path))
    if not path.is_file():
        return f"{path} is missing"
    if not isinstance(manifest, dict) or "sha256" not in manifest:
        return f"{path} has no readable checksum manifest {_manifest(path).name} (its save did not complete)"
    size = path.stat().st_size
    if size != manifest.get("bytes"):
        return f"{path} is {size} bytes, its manifest says {manifest.get('bytes')} (truncated or overwritten)"
    digest = sha256_file(path)
    if digest != manifest["sha256"]:
        return f"{path} fails its checksum (sha256 {digest[:12]}..., manifest {manifest['sha256'][:12]}...)"
    return None


def _complete(ckpt_dir: Path, step: int, tp_size: int) -> bool:
    """Every TP rank's manifest is there (cheap: no hashing; load() verifies the contents)."""
    return all(_manifest(step_dir(ckpt_dir, step) / f"tp{r}.pt").is_file() for r in range(tp_size))


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _gather(obj: Any) -> list:
    """`obj` of every rank (in rank order); the agreement step of load()."""
    if _world() == 1:
        return [obj]
    out: list = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj: Any) -> Any:
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save(ckpt_dir: Path, step: int, state: dict[str, Any], *, keep: int = 2) -> None:
    """Write step `step` (collective: every rank calls it), point ``latest`` at it, rotate to `keep` steps."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    check_plain(state)  # before anything is written: every file here loads with weights_only=True
    st = distributed.state()
    ckpt_dir = Path(ckpt_dir)
    target = step_dir(ckpt_dir, step)

    def write() -> None:
        target.mkdir(parents=True, exist_ok=True)
        write_file(target / f"tp{st.tp_rank}.pt", state, step)

    def commit() -> None:
        _atomic_write(ckpt_dir / "latest", lambda f: f.write(f"{step}\n".encode()))
        older = [s for s in steps_on_disk(ckpt_dir) if s < step and _complete(ckpt_dir, s, st.tp_size)]
        kept = {step, *(older[-(keep - 1):] if keep > 1 else [])}
        for s in steps_on_disk(ckpt_dir):
            if s not in kept:
                shutil.rmtree(step_dir(ckpt_dir, s), ignore_errors=True)

    try:
        _on_all_ranks(write if st.dp_rank == 0 else None, f"checkpoint step {step}", target)  # in place of a barrier
    except Exception:
        if st.rank == 0 and not _complete(ckpt_dir, step, st.tp_size):  # the other ranks' files of a step that
            shutil.rmtree(target, ignore_errors=True)                    # failed: never resumed, so not kept
        raise
    _on_all_ranks(commit if st.rank == 0 else None, f"checkpoint step {step}", ckpt_dir)


def _on_all_ranks(part, what: str, path: Path) -> None:
    """Run this rank's `part` of a save (None: nothing to write here), then agree with every rank on the outcome
    before going on: one int MAX all-reduce when all went well. Where a plain barrier would leave the other ranks
    waiting forever for a rank whose write raised (a full disk on one node), every rank raises: the failed rank its
    own error, the others the first failed rank's disk fault rebuilt as an OSError with the same errno and path (so
    kdexp.track.faults names it in the one line on rank 0, whichever rank met it), or a RuntimeError naming it."""
    err: Optional[Exception] = None
    try:
        if part is not None:
            with faults.writing(path):  # a failed write() names no file: `path` then
                part()
    except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised here; BaseException just ends
        err = exc
    if _world() == 1:
        if err is not None:
            raise err
        return
    flag = torch.tensor([int(err is not None)], device=distributed.state().device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    fault = faults.disk_fault(err)
    mine = None if err is None else (
        ("disk", fault.errno, fault.strerror, fault.filename) if fault is not None else
        ("other", f"{type(err).__name__}: {err}"))
    every = _gather(mine)
    if err is not None:
        raise err
    rank, told = next((r, t) for r, t in enumerate(every) if t is not None)
    if told[0] == "disk":
        raise OSError(told[1], told[2], told[3])
    raise RuntimeError(f"{what} failed on rank {rank}: {told[1]}")


def _committed(ckpt_dir: Path, step: int) -> bool:
    """Some rank's manifest is there: the step's save got past writing a file (an interrupted save has none)."""
    return any(step_dir(ckpt_dir, step).glob("tp*.json"))


def _candidates(ckpt_dir: Path) -> tuple[list[int], Optional[str]]:
    """(steps to try, newest first; an error that stops the resume). Rank 0 decides, the others are told."""
    pointer = Path(ckpt_dir) / "latest"
    latest = latest_step(ckpt_dir)
    on_disk = steps_on_disk(ckpt_dir)
    # A step dir without any manifest that `latest` does not name is a save killed before its first file was
    # committed (only a temp file, or a file without its commit mark): nothing there was ever a checkpoint.
    interrupted = [s for s in on_disk if s != latest and not _committed(ckpt_dir, s)]
    if interrupted:
        log.warning("ignoring %s: their save never completed (no manifest)",
                    ", ".join(str(step_dir(ckpt_dir, s)) for s in interrupted))
    on_disk = [s for s in on_disk if s not in interrupted]
    if latest is not None and latest in on_disk:
        return [latest, *sorted((s for s in on_disk if s < latest), reverse=True)], None
    if pointer.exists():
        try:
            shown = pointer.read_text(errors="replace").strip()[:40]
        except OSError as exc:
            shown = f"<unreadable: {exc}>"
        what = f"{pointer} holds {shown!r}, not a step on disk"
    else:
        what = f"{pointer} is missing"
    if on_disk:
        log.warning("%s: falling back to the newest intact step dir of %s", what, on_disk)
    elif pointer.exists():  # a checkpoint was committed here once and is gone: starting over would hide it
        return [], (f"{what}, and no checkpoint step is left in {ckpt_dir}; remove the directory to start over")
    return sorted(on_disk, reverse=True), None


_UNSAFE = "refused: "  # the prefix of a reason that stops the resume (load() raises UnsafeCheckpoint)


def read_state(path: Path) -> Any:
    """torch.load with weights_only=True on the CPU; UnsafeCheckpoint when the file asks for anything else."""
    try:
        # on the CPU: torch.set_rng_state takes a CPU tensor and AdamW's `step` counters must stay on the host;
        # load_state_dict moves weights and moments to the model's device
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # a file that names a function or class beyond the allowed ones ("unsupported GLOBAL posix.system") was made
        # to run it; any other refusal (a torn or foreign file: "Unsupported operand") is a file that does not load
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if named is None:
            raise
        raise UnsafeCheckpoint(f"{path} is not a kdexp checkpoint: it asks the unpickler for {named.group(1)}, not "
                               "only tensors and plain values, so it could run code and was not loaded; kdexp never "
                               f"writes such a file: remove {path.parent} (or the run dir) if you did not put it "
                               "there") from None


def _load_local(path: Path) -> tuple[Optional[dict], Optional[str]]:
    reason = verify(path)
    if reason is not None:
        return None, reason
    try:
        return read_state(path), None
    except UnsafeCheckpoint as exc:
        return None, _UNSAFE + str(exc)
    except Exception as exc:  # noqa: BLE001 - a checksummed file that does not unpickle is not loadable either
        return None, f"{path} does not load: {type(exc).__name__}: {exc}"


def load(ckpt_dir: Path, *, config_hash: Optional[str] = None) -> Optional[dict[str, Any]]:
    """This TP rank's state at the newest step intact on every rank (collective), or None when there is none.

    A state written by another config (``config_hash`` given and different) is not resumed: None, with a warning.
    """
    st = distributed.state()
    ckpt_dir = Path(ckpt_dir)
    candidates, error = from_rank0(_candidates(ckpt_dir) if st.rank == 0 else None)
    if error is not None:  # every rank raises (rank 0 alone would leave the others waiting in a collective)
        raise faults.DamagedFile(error)
    bad: list[str] = []
    for n, step in enumerate(candidates):
        state, reason = _load_local(step_dir(ckpt_dir, step) / f"tp{st.tp_rank}.pt")
        if state is not None and state.get("step") != step:
            state, reason = None, f"{step_dir(ckpt_dir, step)}/tp{st.tp_rank}.pt holds step {state.get('step')}"
        reasons = sorted({r for r in _gather(reason) if r is not None})
        unsafe = [r.removeprefix(_UNSAFE) for r in reasons if r.startswith(_UNSAFE)]
        if unsafe:  # a tampered run dir: every rank stops here, no fallback to an older step of it
            raise UnsafeCheckpoint("; ".join(unsafe))
        if not reasons:
            if bad and st.rank == 0:
                log.warning("resuming from the intact step %d instead", step)
            if config_hash is not None and state.get("config_hash") != config_hash:
                if st.rank == 0:
                    log.warning("not resuming from %s: it was written by another config", ckpt_dir)
                return None
            return state
        bad += reasons
        if st.rank == 0:
            nxt = f"trying step {candidates[n + 1]}" if n + 1 < len(candidates) else "no older step is left"
            for r in reasons:
                log.warning("checkpoint step %d is not intact: %s; %s", step, r, nxt)
    if bad:
        raise faults.DamagedFile(f"no intact checkpoint in {ckpt_dir} (steps {candidates} all failed: "
                                 f"{'; '.join(bad)}); remove the directory to start over")
    return None
