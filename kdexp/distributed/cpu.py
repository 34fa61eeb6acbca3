"""The ONLY place that answers megatron-core's CUDA assumptions, and only when CUDA is absent.

megatron-core 0.16.1 is written for GPUs. With the local layer spec (no Transformer Engine, no apex) a GPTModel
runs forward and backward on CPU over gloo once these five assumptions are answered:

1. ``torch.cuda.current_device()``: megatron allocates with ``device=torch.cuda.current_device()`` in many places
   (RotaryEmbedding.get_emb moves ``inv_freq`` there on the first forward; GlobalMemoryBuffer.get_tensor holds the
   attention score buffer; the tensor-parallel gathers in tensor_parallel/mappings.py and utils.py). On a CPU build
   of torch it raises "Torch not compiled with CUDA enabled". We answer with ``torch.device("cpu")``, which every
   one of these call sites accepts as a ``device=`` argument.
2. The CUDA RNG states tracker (tensor_parallel/random.py): dropout in attention and the embedding runs inside
   ``get_cuda_rng_tracker().fork()``, and ``model_parallel_cuda_manual_seed`` seeds it with
   ``torch.cuda.manual_seed``. We install :class:`CpuRNGStatesTracker`, which keeps named states of torch's CPU
   generator and swaps them in and out in ``fork`` (so the model-parallel stream stays separate from the default
   stream and results stay deterministic), and :func:`model_parallel_manual_seed` adds the same three named states
   (data/model/expert parallel, same seed offsets) that megatron's own seeding function adds.
3. The default causal mask (transformer/utils.get_default_causal_mask, bound by name into fusions/fused_softmax.py)
   is built with ``device="cuda"`` when no attention mask is passed. kdexp.models always passes an explicit mask;
   the patch makes an accidental ``attention_mask=None`` correct instead of a crash.
4. Activation recompute (trainer.recompute): megatron's CheckpointFunction saves and restores the CUDA generator's
   state next to the CPU one (tensor_parallel/random._get_all_rng_states / _set_all_rng_states). Without CUDA there
   is no CUDA generator: the CPU state and the tracker's states (ours, on the CPU generator) are all there is, so the
   CUDA part becomes an empty placeholder and its restore a no-op.
5. Reduce-scatter (sequence parallelism: the embedding's and each RowParallelLinear's output, the ColumnParallel
   linears' input gradient): megatron calls ``torch.distributed.reduce_scatter_tensor``, which gloo implements only
   in recent torch (2.13 has it; older gloo builds raise). :func:`_gloo_reduce_scatter_tensor` calls it and, where
   gloo refuses, answers with an all_reduce of the whole tensor and this rank's slice of the sum (the same values,
   t times the traffic: a CPU test path, not a fast one).
Nothing here touches torch or megatron when ``torch.cuda.is_available()`` is True. :func:`apply` is idempotent.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED = False


def _cpu_current_device() -> torch.device:
    # Why: megatron passes this straight to ``device=`` / ``.to(device=...)``; "cpu" is what it should mean here.
    return torch.device("cpu")


@functools.lru_cache(maxsize=8)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # Same contract as megatron.core.transformer.utils.get_default_causal_mask: True above the diagonal = masked.
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq, skv, window_size):
    # Same body as megatron's get_sliding_window_causal_mask, on the CPU.
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _no_cuda_rng_restore(*args, **kwargs) -> None:
    return None


class _Done:
    """The handle of an already finished collective (async_op=True callers wait on it)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_NATIVE_REDUCE_SCATTER = [True]  # False once gloo refused reduce_scatter_tensor (then every call takes the fallback)


def _gloo_reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    if _NATIVE_REDUCE_SCATTER[0]:
        try:
            return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError, ValueError):
            # raised before any traffic, on every rank alike (the same torch build): all ranks fall back together
            _NATIVE_REDUCE_SCATTER[0] = False
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"the gloo reduce-scatter answer sums only, asked for {op}")
    total = input.contiguous().clone()
    dist.all_reduce(total, group=group)
    output.copy_(total.chunk(dist.get_world_size(group))[dist.get_rank(group)].view_as(output))
    return _Done() if async_op else None


def _make_tracker_class():
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's RNG states tracker on torch's CPU generator.

        Subclasses CudaRNGStatesTracker so megatron's isinstance checks (get_all_rng_states, checkpointing) and
        get_states/set_states/reset keep working; only the parts that call torch.cuda are replaced.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            # A fresh generator gives the state for `seed` without disturbing the global CPU stream.
            self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def apply() -> bool:
    """Answer megatron-core's CUDA assumptions when CUDA is absent. Returns True when the CPU patches are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = _cpu_current_device

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tf_utils

    for mod in (tf_utils, fused_softmax):
        mod.get_default_causal_mask = _cpu_default_causal_mask
        mod.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = _no_cuda_rng_state
    mp_random._set_cuda_rng_state = _no_cuda_rng_restore

    from megatron.core.tensor_parallel import layers as mp_layers
    from megatron.core.tensor_parallel import mappings as mp_mappings

    # both modules bound torch's function by name at import
    mp_mappings.dist_reduce_scatter_func = mp_layers.dist_reduce_scatter_func = _gloo_reduce_scatter_tensor

    _install_tracker()
    _APPLIED = True
    return True


_TRACKER_CLASS = None


def _install_tracker():
    global _TRACKER_CLASS
    from megatron.core.tensor_parallel import random as mp_random

    if _TRACKER_CLASS is None:
        _TRACKER_CLASS = _make_tracker_class()
    if not isinstance(mp_random._CUDA_RNG_STATE_TRACKER, _TRACKER_CLASS):
        mp_random._CUDA_RNG_STATE_TRACKER = _TRACKER_CLASS()
    # Marked initialized so get_cuda_rng_tracker() never builds megatron's CUDA tracker over ours.
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def model_parallel_manual_seed(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """CPU twin of megatron's ``model_parallel_cuda_manual_seed`` (same names, same seed offsets)."""
    from megatron.core.tensor_parallel import random as mp_random

    apply()
    _install_tracker()  # again: megatron's initialize_rng_tracker(force_reset=True) may have replaced it
    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    # The default (data-parallel) stream is torch's global CPU generator.
    torch.manual_seed(seed)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
