"""Process groups and megatron-core parallel state for kdexp.

``initialize()`` is the one entry point: it finds out who this process is (torchrun, submitit, plain SLURM srun,
or a lone local process), creates the torch.distributed default group (nccl on CUDA, gloo on CPU), builds
megatron's tensor/pipeline/data parallel groups and seeds megatron's model-parallel RNG. On a machine without CUDA
it first applies kdexp.distributed.cpu, the only place that answers megatron's CUDA assumptions, and the host
allocator policy of kdexp.distributed.hostmem.

Typical use (trainer)::

    st = kdexp.distributed.initialize(tensor_parallel=cfg.parallel.tensor, seed=cfg.seed)
    ... st.rank, st.tp_rank, st.dp_rank, st.dp_size, st.device ...
    if kdexp.distributed.is_rank0(): write files
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import importlib
from typing import Optional

from kdexp.distributed.launch import launch_env


class _OnFirstUse:
    """A module imported when first used. ``import kdexp.distributed.launch`` (the stdlib-only rank lookup that
    kdexp.track asks in processes that never train) runs this package's __init__ too, which must then not cost
    torch's ~2 s import; everything below touches torch only inside functions, through these names."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


torch = _OnFirstUse("torch")
dist = _OnFirstUse("torch.distributed")
cpu = _OnFirstUse("kdexp.distributed.cpu")
hostmem = _OnFirstUse("kdexp.distributed.hostmem")

__all__ = ["DistState", "initialize", "state", "tp_group", "dp_group", "is_rank0", "destroy", "is_initialized", "reseed",
           "barrier", "rank0_decides", "sum_grads_over_tp"]


@dataclasses.dataclass(frozen=True)
class DistState:
    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device
    backend: str
    pp_size: int = 1
    pp_rank: int = 0
    source: str = "local"  # where rank/world came from: torchrun | submitit | slurm | local | existing


_STATE: Optional[DistState] = None


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _launch_env():
    """(rank, world_size, local_rank, master_addr, master_port, source); master_port None = pick a free one."""
    launch = launch_env()
    return (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.master_port,
            launch.source)


def _init_process_group(backend: str) -> tuple[int, int, int, str]:
    rank, world, local_rank, addr, port, source = _launch_env()
    if backend == "nccl":
        # Before the group exists, and also when a caller made the group already (every local rank would use cuda:0).
        # Modulo: where SLURM binds each task to its own GPU (--gpus-per-task, gpu-bind) a task sees one device,
        # index 0, whatever its local rank.
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank, "existing"
    timeout = datetime.timedelta(minutes=30)
    if source == "torchrun" and (port is not None or world > 1):
        # env:// lets torchrun's agent store (already listening on MASTER_PORT) serve the rendezvous.
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    elif port is None or world == 1:
        # Single process (also a one-task submitit or SLURM job, whose port is derived from the job id and may be
        # taken): nothing to agree on, so let the OS pick the port while the store binds it (no find-then-bind race).
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=timeout)
    return rank, world, local_rank, source


def initialize(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234) -> DistState:
    """Create (once) the process group, megatron's parallel state and the model-parallel RNG; return DistState.

    Calling it again with the same sizes returns the existing state; other sizes raise (call destroy() first).
    """
    global _STATE
    from megatron.core import parallel_state as ps

    tp = _check_size("parallel.tensor", tensor_parallel)
    pp = _check_size("parallel.pipeline", pipeline_parallel)
    if _STATE is not None:
        if (_STATE.tp_size, _STATE.pp_size) != (tp, pp):
            raise ValueError(
                f"parallel.tensor/parallel.pipeline: already initialized with tensor={_STATE.tp_size} "
                f"pipeline={_STATE.pp_size}, asked for tensor={tp} pipeline={pp}; call destroy() first")
        return _STATE

    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu.apply()
        hostmem.keep_freed_memory()  # the step's large tensors reuse freed heap blocks, not fresh pages
    backend = "nccl" if use_cuda else "gloo"
    rank, world, local_rank, source = _init_process_group(backend)
    atexit.unregister(_destroy_at_exit)  # once, however often a process initializes (tests destroy and start again)
    atexit.register(_destroy_at_exit)
    if world % (tp * pp) != 0:
        raise ValueError(
            f"parallel.tensor={tp} (x parallel.pipeline={pp}) must divide the world size {world}")

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tp_rank = ps.get_tensor_model_parallel_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    _seed(seed, tp_rank, use_cuda)
    _STATE = DistState(
        rank=rank, world_size=world, local_rank=local_rank,
        tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=tp_rank,
        dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
        device=device, backend=dist.get_backend(),
        pp_size=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        source=source)
    return _STATE


def _seed(seed: int, tp_rank: int, use_cuda: bool) -> None:
    if use_cuda:
        from megatron.core import tensor_parallel as mp_tensor_parallel

        mp_tensor_parallel.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
    else:
        cpu.model_parallel_manual_seed(seed, tp_rank=tp_rank)


def reseed(seed: int) -> None:
    """Reset torch's and megatron's model-parallel RNG streams, e.g. so a model's init does not depend on what was
    built or trained before it in the same process."""
    st = state()
    _seed(seed, st.tp_rank, st.device.type == "cuda")


def is_initialized() -> bool:
    return _STATE is not None


def state() -> DistState:
    if _STATE is None:
        raise RuntimeError("kdexp.distributed.initialize() has not been called")
    return _STATE


def tp_group():
    """Megatron's tensor-parallel process group of this rank."""
    from megatron.core import parallel_state as ps

    state()
    return ps.get_tensor_model_parallel_group()


def dp_group():
    """Megatron's data-parallel process group of this rank."""
    from megatron.core import parallel_state as ps

    state()
    return ps.get_data_parallel_group()


def sum_grads_over_tp(params) -> None:
    """Sum over the TP group, in one flat all_reduce, the gradients of the parameters tagged ``tp_summed_grad``
    (kdexp.models.norms.mark_tp_summed: q/k norms, and every norm under sequence parallelism): megatron's
    finalize_model_grads rule (_allreduce_non_tensor_model_parallel_grads). Reads ``main_grad`` where megatron's DDP
    keeps it, else ``grad``. Call it once per step, after the backward of the last micro-batch, before clipping."""
    st = state()
    if st.tp_size == 1:
        return
    grads = []
    for p in params:
        if getattr(p, "tp_summed_grad", False):
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(g)
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group())
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def is_rank0() -> bool:
    """True on global rank 0 (and when torch.distributed is not set up at all): the only rank that writes."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True


def barrier() -> None:
    """torch.distributed.barrier() when a process group is initialized, else nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank0_decides(flag: bool) -> bool:
    """Global rank 0's view of a file-system fact, for every rank (so that all ranks take the same branch and their
    collectives stay in step); `flag` itself when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    # nccl broadcasts only CUDA tensors: use this rank's device (a bare gloo group without initialize(): the CPU).
    device = _STATE.device if _STATE is not None else torch.device("cpu")
    value = torch.tensor([int(bool(flag))], device=device)
    dist.broadcast(value, src=0)
    return bool(value.item())


_ENDED_CLEANLY = False  # ended_cleanly(): the process group is destroyed at exit


def ended_cleanly() -> None:
    """Every rank is done with its collectives (the run finished, or every rank agreed to stop after a checkpoint):
    the process group is destroyed at the interpreter's exit (an atexit handler of initialize()), as torch asks.
    Without it gloo's worker threads now and then abort the exit (SIGABRT, "terminate called without an active
    exception"): a finished TP 2 run that torchrun then reports as failed. Not after a failure, where a peer may still
    wait in a collective and destroying the group can hang."""
    global _ENDED_CLEANLY
    _ENDED_CLEANLY = True


def _destroy_at_exit() -> None:
    if _ENDED_CLEANLY and dist.is_available() and dist.is_initialized():
        destroy()


def destroy() -> None:
    """Tear down megatron's parallel state and the process group (tests; the end of a run: ended_cleanly)."""
    global _STATE
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = None
