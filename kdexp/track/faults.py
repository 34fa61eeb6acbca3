"""Faults of the machine, not of the run: a full disk, a read-only or unwritable directory. A single run that meets
one ends with one line naming the path and the cause (``kdexp: error: cannot write PATH: No space left on device
(ENOSPC)``) and exit status 1, without a traceback, and leaves no partial file behind (every record is written to a
temp file then renamed, metrics.jsonl drops a half-written line, a checkpoint step that did not commit is removed).

- `disk_fault(exc)` finds such an OSError anywhere in an exception's chain (torch.save turns ENOSPC into a
  RuntimeError "unexpected pos" whose context is the OSError);
- `one_line(exc)`: that line for an exception, and a ConfigError's (a sweep records it as the point's error and
  prints it: kdexp.track);
- `ending(exc)`: the one decision of how a single run that raised `exc` ends (exit status, one line or a traceback,
  what its error.log gets), read by kdexp.run and kdexp.train's run_point;
- `writing(path)` names the path on an OSError that has none (a failed ``write()`` carries no file name);
- `WritableDirs`, a Hydra callback, tries the run (or sweep) directory before Hydra creates it and writes its config
  there: a read-only directory, a directory that cannot be created or a disk that cannot take 64 KiB stops the run
  with the one line before any work (Hydra would print a traceback from its own ``mkdir``);
- `watch_log_files()`: a log file handler (run.log) that cannot write records the fault for `raise_pending()` (at
  the next step boundary) instead of printing logging's traceback for every record.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

from hydra.experimental.callback import Callback

from kdexp.distributed.launch import launch_env
from kdexp.rules import ConfigError
from kdexp.track.claim import clean_up_on_sigterm_before_claim, note_new_dirs, wait_for_rank_0

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
PROBE_BYTES = 64 * 1024  # what .hydra/, run.log and the first records need before the first checkpoint

_PENDING: list[OSError] = []


def disk_fault(exc: Optional[BaseException]) -> Optional[OSError]:
    """The first OSError with a disk errno in `exc`'s chain (itself, its __cause__ and __context__), else None."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__]
    return None


def describe(err: OSError, path: Any = None) -> str:
    """``cannot write PATH: No space left on device (ENOSPC)``."""
    where = err.filename if err.filename is not None else path
    code = errno.errorcode.get(err.errno, str(err.errno))
    return f"cannot write {where if where is not None else '<unknown path>'}: {os.strerror(err.errno)} ({code})"


def is_diverged(err: BaseException) -> bool:
    """kdexp.train's ``Diverged`` (a RuntimeError subclass), matched by class name so that kdexp.run needs no import
    of the training code before the config is known good (and works where that class does not exist)."""
    return isinstance(err, RuntimeError) and any(c.__name__ == "Diverged" for c in type(err).__mro__)


class DamagedFile(RuntimeError):
    """A file the run needs is damaged, missing or refused (its checkpoints, the shipped teacher): the message names
    the file and what to do; a single run ends with it as one line, exit 1, a sweep point records it as its error."""


class Ending(NamedTuple):
    """How a single run that raised ends. ``code``: the exit status; ``line``: printed on stderr instead of a
    traceback (None: the traceback, Hydra prints it); ``traceback_as``: the heading under which run_point records the
    traceback in run.log and error.log (None: no traceback there; a refused run writes nothing, kdexp.track.claim)."""

    code: int
    line: Optional[str]
    traceback_as: Optional[str]


def ending(exc: BaseException) -> Ending:
    """Which errors end a single run with one line, decided once: a config error that only the data or the teacher
    cache shows (``kdexp.rules.ConfigError``: exit 2), a divergence (exit 1; summary.json and the traceback say
    where), a disk fault anywhere in the chain or a damaged file (``DamagedFile``; exit 1, the path and the cause).
    Anything else is a traceback, exit 1.
    In a sweep every exception goes to the sweep callback instead (kdexp.track.sweep)."""
    if isinstance(exc, ConfigError):
        return Ending(2, f"kdexp: error: {exc}", None)
    if is_diverged(exc):
        return Ending(1, f"kdexp: {exc}", "run diverged")
    line = one_line(exc)
    if line is not None:
        return Ending(1, f"kdexp: error: {line}", None)
    return Ending(1, None, "run failed")


def one_line(exc: Optional[BaseException]) -> Optional[str]:
    """The line a single run prints instead of a traceback (after ``kdexp: error: ``), which a sweep point that
    raised `exc` prints and records as its error too: `describe` of the disk fault in `exc`'s chain, or the message
    of a ``ConfigError`` (a value only the prepared data or the teacher cache shows wrong) or a ``DamagedFile``; None
    for anything else."""
    fault = disk_fault(exc)
    if fault is not None:
        return describe(fault)
    return str(exc) if isinstance(exc, (ConfigError, DamagedFile)) else None


@contextlib.contextmanager
def writing(path: Any) -> Iterator[None]:
    """Give a disk fault raised inside the block that names no file the name `path`."""
    try:
        yield
    except BaseException as exc:
        fault = disk_fault(exc)
        if fault is not None and fault.filename is None:
            fault.filename = str(path)
        raise


def probe(directory: Path, nbytes: int = PROBE_BYTES) -> Optional[str]:
    """None when `directory` can be created and takes `nbytes` (written, synced, removed), else the fault line."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".kdexp-write-probe.")
        try:
            with writing(directory):
                os.write(fd, b"\0" * nbytes)
                os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as err:
        if err.errno not in DISK_ERRNOS:
            raise
        return describe(err, directory)
    return None


def stop(line: str) -> None:
    print(f"kdexp: error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(1)


class WritableDirs(Callback):
    """Before Hydra makes the run (sweep) directory: try it. SystemExit(1) with the one line, because Hydra turns a
    callback's ordinary exception into a warning and goes on."""

    def on_run_start(self, config, **kwargs: Any) -> None:
        run_dir = Path(str(config.hydra.run.dir))
        launch = launch_env()
        if launch.world_size > 1 and launch.rank != 0:
            wait_for_rank_0(run_dir)  # rank 0 makes the run dir (and removes it when it refuses)
        note_new_dirs(run_dir)  # a refused run removes the dirs made for it
        clean_up_on_sigterm_before_claim()  # as does one that SIGTERM stops before its claim
        line = probe(run_dir)
        if line is not None:
            stop(line)

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        line = probe(Path(str(config.hydra.sweep.dir)))
        if line is not None:
            stop(line)


def watch_log_files() -> None:
    """Route a disk fault of any logging.FileHandler into `raise_pending` (the handler is dropped: console only)."""
    loggers = [logging.getLogger(), *(v for v in logging.root.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if not isinstance(handler, logging.FileHandler) or getattr(handler, "_kdexp_watched", False):
                continue
            handler._kdexp_watched = True
            handler.handleError = _handle_error(logger, handler, handler.handleError)


def _handle_error(logger: logging.Logger, handler: logging.FileHandler, original):
    def handle_error(record: logging.LogRecord) -> None:
        fault = disk_fault(sys.exc_info()[1])
        if fault is None:
            return original(record)
        if fault.filename is None:
            fault.filename = handler.baseFilename
        _PENDING.append(fault)
        logger.removeHandler(handler)
    return handle_error


def raise_pending() -> None:
    """Raise the first disk fault a log file met since the last call (see `watch_log_files`)."""
    if _PENDING:
        fault = _PENDING[0]
        _PENDING.clear()
        raise fault
