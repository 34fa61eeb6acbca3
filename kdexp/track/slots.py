"""How many points of a submitit-local sweep train at once, and with how many CPU threads each.

submitit's LocalExecutor starts every job of a sweep at once and has no array parallelism (SLURM's ``--array=%N``).
On a laptop or this 2-core box that means N points x torch's default thread count on a few cores: 12 points of
`experiment=qwen3_before_after` run each step many times slower than one point alone (OpenMP threads spinning
against each other): an hour for what runs in minutes one after another.

So a point that runs under the local executor (``SUBMITIT_LOCAL_JOB_ID`` set, one task per job) first takes one of
``launch.local_parallel`` slots: an exclusive ``flock`` on ``<sweep dir>/.kdexp_slots/slot-<i>.lock``, held by the
process until it exits (a killed point frees its slot; nothing to clean up), and waits while all are taken. Then it
sets torch's intra-op threads to ``launch.cpu_threads`` (default: the cores this process may use // the slots). Points
of other launchers (basic, SLURM) and multi-task local jobs are not capped; ``launch.cpu_threads`` still applies.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("kdexp")

SLOTS_DIR = ".kdexp_slots"
_HELD: list[tuple[int, int]] = []  # (open descriptor, slot) this process holds: released when it exits


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask: a cgroup or taskset limit counts, not the machine)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def default_parallel() -> int:
    """Points at once on the local executor when launch.local_parallel is null: one per 2 cores (at least 1)."""
    return max(1, cpu_cores() // 2)


def under_local_executor() -> bool:
    """True in a single-task job of submitit's LocalExecutor (hydra/launcher=local_cpu / submitit_local)."""
    return "SUBMITIT_LOCAL_JOB_ID" in os.environ and int(os.environ.get("SUBMITIT_LOCAL_NTASKS", "1")) == 1


def acquire(sweep_dir, parallel: int, poll_s: float = 0.5, on_wait=None) -> tuple[int, float]:
    """Block until one of `parallel` slots under `sweep_dir` is free, take it for the life of this process; returns
    (slot index, seconds waited). Re-entrant: a process that already holds a slot gets it back at once.
    `on_wait(waiting)`: called with True when all slots are taken and this process starts to wait, with False once
    it has its slot after waiting (the point records itself as pending meanwhile)."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"launch.local_parallel={parallel!r} is invalid: must be an integer >= 1 (or null)")
    if _HELD:
        return _HELD[0][1], 0.0
    d = Path(sweep_dir) / SLOTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    said = False
    while True:
        for i in range(parallel):
            fd = os.open(d / f"slot-{i}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # who holds it (for a person looking; the lock is the flock)
            _HELD.append((fd, i))
            if said and on_wait is not None:
                on_wait(False)
            return i, time.monotonic() - start
        if not said:
            log.info("waiting for a local slot: %d point(s) of this sweep train at once (launch.local_parallel)",
                     parallel)
            said = True
            if on_wait is not None:
                on_wait(True)
        time.sleep(poll_s)


def take_local_slot(launch_cfg, sweep_dir, on_wait=None) -> Optional[int]:
    """What a sweep point does before it trains (kdexp.train.point): under the local executor take a slot (`on_wait`
    as in `acquire`); then set torch's CPU threads. Returns the slot index, or None when not capped."""
    import torch

    slot, parallel = None, None
    if under_local_executor() and sweep_dir is not None:
        parallel = launch_cfg.local_parallel if launch_cfg.local_parallel is not None else default_parallel()
        slot, waited = acquire(sweep_dir, parallel, on_wait=on_wait)
    threads = launch_cfg.cpu_threads
    if threads is None and parallel is not None:
        threads = max(1, cpu_cores() // parallel)
    if threads is not None:
        torch.set_num_threads(int(threads))
    if slot is not None:
        log.info("local slot %d of %d (waited %.1f s), %d CPU thread(s)", slot, parallel, waited,
                 torch.get_num_threads())
    return slot
