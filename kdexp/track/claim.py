"""Claiming a run dir before anything is written into it: one writer per run dir, and a refused run leaves no trace.

A run (or sweep point) first does every check that writes nothing (kdexp.run: the config, the launch, the plan),
then ``claim``s its run dir, and only then writes there:

1. the owner check (``run.json`` / ``summary.json`` read, nothing written): another config's run is ``RunDirTaken``;
2. an exclusive ``flock`` on ``<run dir>/.kdexp.lock``, non-blocking: a dir another live process holds is
   ``RunDirBusy``, one line naming that process's pid and host. Refused rather than waited for: the holder is a run
   of the same dir still going (a second terminal, an orphaned sweep worker after its driver was killed), and a
   wait would hold a slot or a node idle for as long as that run trains, with nothing said; the line names the pid
   to wait for or to kill. The kernel releases the lock when the holder dies, so a crashed run never blocks the next;
3. the owner check again, now that no other process can write here; ``trainer.overwrite``; ``run.json``;
4. what waited for the claim: Hydra's ``.hydra/`` files (``hydra.output_subdir`` is null in kdexp's config, so Hydra
   itself writes nothing before the task runs; they are written here, as Hydra writes them), ``run.log`` (Hydra's file
   handler is ``RunLog``, which holds its records until the claim) and the sweep callback's point record
   (``after_claim``).

Hydra creates the run dir before the task runs; a refused run removes it again when it is empty, with the empty
parents this process created (``note_new_dirs``, called before Hydra's first mkdir); so does a run that SIGTERM stops
before its claim. Under a launch of several processes the other ranks wait for rank 0's claim before their Hydra
makes the dir (``wait_for_rank_0``). The lock is held by global rank 0 until the process ends or claims another dir
(``release``: a sweep's in-process points, one after another).
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

from kdexp.distributed.launch import launch_env
from kdexp.track import records
from kdexp.track.rundir import RunDirTaken, owner

LOCK = ".kdexp.lock"
HYDRA_DIR = ".hydra"

# What a run writes into its run dir, removed when the user asks to start over (trainer.overwrite=true); the W&B id
# goes so that the new run gets its own record. Logs are appended; .hydra/ is written anew at every claim.
_RUN_OUTPUTS = (records.SUMMARY, records.METRICS, records.RUN, "wandb_id", "checkpoints", "student_hf")


class RunDirBusy(RunDirTaken):
    """A run dir another live process holds (its lock): refused before anything is written."""


_held: dict[Path, int] = {}  # run dir -> descriptor of its locked .kdexp.lock (this process)
_waiting: dict[Path, list[Callable[[], None]]] = {}  # run dir -> what runs once it is claimed
_new_dirs: list[Path] = []  # dirs this process is about to create for its run (a single run), outermost first
_noted: list[Path] = []  # the run dir _new_dirs was noted for
_fresh: set[Path] = set()  # claimed dirs that held nothing of a run before this process claimed them
_claimed_unlocked: set[Path] = set()  # claimed on a rank other than 0, or where the filesystem has no flock
WAIT_FOR_RANK_0_S = 120.0  # wait_for_rank_0: how long the other ranks wait for rank 0's claim of the run dir


def _key(run_dir) -> Path:
    return Path(run_dir).resolve()


def holder(run_dir) -> Optional[str]:
    """"pid P on host H since T" of the live process holding ``run_dir``'s lock, else None. Writes nothing."""
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return (os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _lock(run_dir: Path) -> None:
    """Take ``run_dir``'s lock for this process (again: a no-op); RunDirBusy naming the holder when it is taken."""
    key = _key(run_dir)
    if key in _held:
        return
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirBusy(f"{run_dir} is in use by the run of {who}: not run twice into one run dir; wait for "
                         "that run to end (or stop it), then rerun") from None
    except OSError:  # no flock on this filesystem: the owner check alone, as before locks existed
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since {records.now()}\n".encode(), 0)
    _held[key] = fd


def release(run_dir=None) -> None:
    """Give up the claim (and the lock) of ``run_dir``; of every dir this process claimed when None."""
    for key in ([_key(run_dir)] if run_dir is not None else [*_held, *_claimed_unlocked]):
        fd = _held.pop(key, None)
        _claimed_unlocked.discard(key)
        _waiting.pop(key, None)
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock


def is_claimed(run_dir) -> bool:
    """This process has claimed ``run_dir`` (and not released it)."""
    return _key(run_dir) in _held or _key(run_dir) in _claimed_unlocked


def after_claim(run_dir, action: Callable[[], None]) -> None:
    """Run ``action`` once this process has claimed ``run_dir`` (at once when it already has)."""
    if is_claimed(run_dir):
        action()
    else:
        _waiting.setdefault(_key(run_dir), []).append(action)


def note_new_dirs(run_dir) -> None:
    """Remember which of ``run_dir`` and its parents do not exist yet (before Hydra makes them), so that a refused
    run removes them again (``refused``)."""
    path = _key(run_dir)
    missing = []
    while not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    _new_dirs[:] = list(reversed(missing))
    _noted[:] = [_key(run_dir)]


def wait_for_rank_0(run_dir) -> None:
    """On a rank other than global rank 0 of a launch of several processes (torchrun, srun), before Hydra makes
    ``run_dir`` there: wait until rank 0 has claimed it (its lock file is there; at most ``WAIT_FOR_RANK_0_S``, for a
    run dir rank 0 cannot share). Rank 0 alone checks, makes, and on a refusal removes the run dir: when every rank's
    Hydra made it, one rank's refusal could remove it and another rank's Hydra make it again, and the dir stayed
    behind. A refused config is refused by rank 0 before its claim, and the launcher then stops the waiting ranks."""
    lock = Path(run_dir) / LOCK
    deadline = time.monotonic() + WAIT_FOR_RANK_0_S
    while not lock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def clean_up_on_sigterm_before_claim() -> None:
    """From now until the claim, SIGTERM first removes the dirs made for this run (``_stopped_before_claim``); the
    claim puts the default action back (``_claimed_sigterm``)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stopped_before_claim)


def _claimed_sigterm() -> None:
    """The claim is made: SIGTERM's default action again, so that training's handler (kdexp.train.signals), which
    calls the handler it replaced after its checkpoint, finds no handler of the unclaimed run to call."""
    ours = signal.getsignal(signal.SIGTERM) is _stopped_before_claim
    if ours and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stopped_before_claim(signum, frame) -> None:
    """SIGTERM before the run claimed its dir (torchrun stops rank 0 when another rank refused; a scheduler cancels a
    run still composing): the dirs made for it go, as for a refused run, then the signal ends the process as it
    would have (status 128 + 15). After the claim the run's own dir stays; training installs its own handler
    (kdexp.train.signals) once it starts."""
    if _noted and not is_claimed(_noted[0]):
        refused(_noted[0])
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def claim(run_dir, key: str, *, overwrite: bool, job=None) -> None:
    """Make ``run_dir`` this config's (``key``) run dir; see the module docstring. ``job``: the task config of the
    Hydra job running now, whose ``.hydra/`` files are written once the dir is claimed. Global rank 0 takes the lock
    and writes; the other ranks only check."""
    run_dir = Path(run_dir)
    taken = _taken(run_dir, key, overwrite)
    if taken is not None:
        raise taken
    rank0 = launch_env().rank == 0
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        for other in [k for k in (*_held, *_claimed_unlocked) if k != _key(run_dir)]:
            release(other)  # a sweep's in-process points: the previous point's dir is done with
        _lock(run_dir)
        taken = _taken(run_dir, key, overwrite)  # a run that claimed it between the first look and the lock
        if taken is not None:
            release(run_dir)
            raise taken
        held = owner(run_dir)
        if held is None and not any(p.name != LOCK for p in run_dir.iterdir()):
            _fresh.add(_key(run_dir))
        if held is not None and held != key:  # overwrite: that run's outputs go
            for name in _RUN_OUTPUTS:
                path = run_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        if held != key:
            records.write_json(run_dir / records.RUN, {"config_hash": key})
    if _key(run_dir) not in _held:
        _claimed_unlocked.add(_key(run_dir))
    if rank0 and job is not None:
        from kdexp.track.hydra_adapter import save_job_files

        save_job_files(run_dir / HYDRA_DIR, job)
    _claimed_sigterm()
    for log in list(_RUN_LOGS):
        log.flush_held()
    for action in _waiting.pop(_key(run_dir), []):
        action()


def _taken(run_dir: Path, key: str, overwrite: bool) -> Optional[RunDirTaken]:
    held = owner(run_dir)
    if held is not None and held != key and not overwrite:
        return RunDirTaken(f"{run_dir} holds the run of another config ({held}; this config is {key}): not "
                           "overwritten; use another run dir (hydra.run.dir=...), or trainer.overwrite=true to "
                           "delete that run and start over")
    return None


def refused(run_dir) -> None:
    """A run refused before it claimed ``run_dir``: nothing of it stays. What waited for the claim is dropped, records
    held for run.log are dropped, and the dir (and the parents this process created for it) goes when empty."""
    key = _key(run_dir)
    _waiting.pop(key, None)
    for log in list(_RUN_LOGS):
        log.drop_held(key)
    # the dirs made for this run: those noted before Hydra made them (a single run), else the point's own dir (Hydra
    # makes a sweep point's dir just before the job runs)
    made = list(reversed(_new_dirs)) if _noted == [key] else [key]
    for path in made:
        try:
            path.rmdir()  # only an empty dir: another run's files are never touched
        except FileNotFoundError:
            continue
        except OSError:
            break
    _new_dirs.clear()
    _noted.clear()


def withdraw(run_dir) -> None:
    """A run refused after it claimed ``run_dir`` (a value only its data or teacher cache shows wrong, exit 2): a dir
    that held nothing before this process claimed it is removed whole; one that held this config's earlier run
    keeps it, and this attempt adds nothing more (no error.log)."""
    key = _key(run_dir)
    release(run_dir)
    if key in _fresh and launch_env().rank == 0:
        shutil.rmtree(key, ignore_errors=True)
        refused(key)


# ----------------------------------------------------------------------------------------------------------------------
# run.log: Hydra's job log file, opened once the run dir is claimed

_RUN_LOGS: "weakref.WeakSet[RunLog]" = weakref.WeakSet()
_HOLD_AT_MOST = 10_000  # records held before the claim (a few in practice): a bound, not a buffer


class RunLog(logging.FileHandler):
    """Hydra's ``run.log`` handler (``hydra.job_logging.handlers.file.class``): a FileHandler that neither creates
    nor writes its file before this process claims the file's dir; the records logged before are written then, in
    order (or dropped with a refused run)."""

    def __init__(self, filename, mode: str = "a", encoding=None, errors=None) -> None:
        super().__init__(filename, mode, encoding, delay=True, errors=errors)
        self._held: list[logging.LogRecord] = []
        _RUN_LOGS.add(self)

    def _dir(self) -> Path:
        return _key(Path(self.baseFilename).parent)

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is None and not is_claimed(self._dir()):
            if len(self._held) < _HOLD_AT_MOST:
                self._held.append(record)
            return
        self.flush_held()
        super().emit(record)

    def flush_held(self) -> None:
        if self._held and is_claimed(self._dir()):
            held, self._held = self._held, []
            for record in held:
                super().emit(record)

    def drop_held(self, run_dir: Path) -> None:
        if self._dir() == run_dir:
            self._held = []


# ----------------------------------------------------------------------------------------------------------------------
# which Hydra task claims its run dir

def claims_its_run_dir(task):
    """Mark a Hydra task function that claims its run dir before it writes there (kdexp.run.main): the sweep callback
    then writes the point's record only once the claim is made, and a job that ended without one was refused."""
    task.kdexp_claims_run_dir = True
    return task


def claims(task) -> bool:
    return bool(getattr(task, "kdexp_claims_run_dir", False))
