"""Run a function on N local gloo processes, the way torchrun would start them (for tests).

    from kdexp.distributed.testing import run_on_processes

    def _worker(rank, world_size, tp):            # module-level, so spawn can import it
        st = kdexp.distributed.initialize(tensor_parallel=tp)
        ...
        return some_picklable_value               # e.g. tensors (.detach().clone()), floats, dicts

    results = run_on_processes(_worker, 2, args=(2,))   # -> [value of rank 0, value of rank 1]

The ranks are forked from multiprocessing's fork server, which imports torch and megatron-core once per parent
process (PRELOAD): a spawned rank would import them again, about 4 s of CPU each on a small machine, which is most
of what a short test's ranks do. The server is a fresh interpreter that has run no torch op and started no thread,
so forking it is as safe as spawning; a child gets what a spawned one gets besides: the parent's environment and
working directory at the call, sys.path, and the parent's standard output and error (passed at each start, not the
server's).

Each child gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a
free port) so kdexp.distributed.initialize() takes its torchrun path, one intra-op thread (the CPU is shared), and
kdexp.distributed.destroy() after fn returns. A failure in any rank is raised in the parent with that rank's
traceback; a hang is killed after `timeout` seconds.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import socket
import time
import traceback
from multiprocessing import reduction

# What the ranks' fork server imports once (ImportErrors ignored: a module the machine lacks is the rank's to import).
PRELOAD = ("torch", "numpy", "megatron.core", "megatron.core.models.gpt", "megatron.core.tensor_parallel",
           "megatron.core.inference.contexts", "megatron.core.optimizer", "megatron.core.distributed")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CallerStdio:
    """The caller's standard output and error, pickled as descriptors when a rank starts; attach() makes them the
    rank's fd 1 and 2."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out, err

    def __reduce__(self):
        return type(self), (reduction.DupFd(1), reduction.DupFd(2))

    def attach(self) -> None:
        import sys

        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for target, dup in ((1, self.out), (2, self.err)):
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)


def _child(fn, rank, world_size, port, args, kwargs, env, results, caller_env, stdio):
    try:
        stdio.attach()
        os.environ.clear()  # the caller's environment now, not the fork server's when it started
        os.environ.update(caller_env)
        os.environ.update({
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        })
        os.environ.update(env or {})
        import torch

        torch.set_num_threads(1)
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            import kdexp.distributed as kd

            if kd.is_initialized() or torch.distributed.is_initialized():
                kd.destroy()
        # torch.save bytes, not the objects: a tensor put on a Queue lives in the child's shared memory, which
        # may be gone by the time the parent reads it.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def run_on_processes(fn, nprocs: int = 2, *, args=(), kwargs=None, env=None, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on `nprocs` new processes; return the results by rank."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first call of this process)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, nprocs, port, tuple(args), dict(kwargs or {}), env, results,
                                              dict(os.environ), _CallerStdio()),
                         daemon=False) for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < nprocs and not errors:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died without reporting (segfault, OOM kill) would otherwise cost the full timeout.
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    errors.append(f"ranks exited without a result (rank, exit code): {dead}")
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"run_on_processes: no result from some rank within {timeout}s") from None
                continue
            if ok:
                import torch

                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")  # other ranks may hang in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("run_on_processes: a rank failed\n" + "\n".join(errors))
    return [out[r] for r in range(nprocs)]
