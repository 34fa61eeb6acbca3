"""The CUDA-only branches of kdexp, run on the CPU where that is honest.

No CPU test reached them before (that is how `_seed` shipped a NameError that every GPU run hit in initialize()).
Each test forces one branch: `torch.cuda.is_available()` answers True, and the few calls a CPU build of torch cannot
make (set_device, nccl, Module.cuda, the CUDA generator) are recorded instead; what runs is kdexp's own code and,
wherever it can, megatron's real code.
"""
import pytest
import torch
import torch.distributed as dist

import kdexp.distributed as kd
from kdexp.distributed import cpu
from kdexp.distributed.testing import free_port
from _lone_process import lone_process


@pytest.fixture
def torchrun_rank(monkeypatch):
    """A lone torchrun process (world 1) whose LOCAL_RANK is 3: the GPU it must select."""
    with lone_process(monkeypatch=monkeypatch):
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", "3")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        yield


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.is_available() is True; set_device/current_device/nccl/megatron's CUDA seeding are recorded."""
    from megatron.core import tensor_parallel

    calls = []
    device = {"index": 0}

    def set_device(d):
        calls.append(("set_device", d))
        device["index"] = d

    real_init = dist.init_process_group

    def init_process_group(backend=None, **kw):
        calls.append(("init_process_group", backend))
        return real_init(backend="gloo", **kw)  # the CPU build has no nccl; the rest of the call is kdexp's

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device["index"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed",
                        lambda seed, *a, **kw: calls.append(("model_parallel_cuda_manual_seed", seed, a, kw)))
    monkeypatch.setattr(cpu, "apply", lambda: pytest.fail("cpu.apply() ran on the CUDA path"))
    return calls


def test_initialize_cuda_branch_selects_the_gpu_uses_nccl_and_seeds_megatron(torchrun_rank, fake_cuda):
    st = kd.initialize(tensor_parallel=1, seed=4321)
    assert fake_cuda[:2] == [("set_device", 3), ("init_process_group", "nccl")]  # the device before the group
    assert st.device == torch.device("cuda", 3) and (st.local_rank, st.source) == (3, "torchrun")
    assert fake_cuda[2:] == [("model_parallel_cuda_manual_seed", 4321, (), {})]
    assert torch.initial_seed() == 4321  # the default stream too
    kd.reseed(99)  # the trainer's reseed before each model build takes the same branch
    assert fake_cuda[-1] == ("model_parallel_cuda_manual_seed", 99, (), {}) and torch.initial_seed() == 99


def test_initialize_cuda_branch_with_one_visible_gpu_per_task(torchrun_rank, fake_cuda, monkeypatch):
    """SLURM with --gpus-per-task=1 (or gpu binding): local rank 3 sees a single GPU, which is device 0."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    st = kd.initialize(tensor_parallel=1, seed=1)
    assert fake_cuda[0] == ("set_device", 0) and st.device == torch.device("cuda", 0) and st.local_rank == 3


def test_megatron_cuda_seeding_and_the_cpu_twin_agree(monkeypatch):
    """The states megatron's model_parallel_cuda_manual_seed adds (names, seed offsets) are those of
    cpu.model_parallel_manual_seed, so a CPU run and a GPU run draw from the same named streams."""
    from megatron.core.tensor_parallel import random as mp_random

    added = []
    monkeypatch.setattr(mp_random, "_CUDA_RNG_STATE_TRACKER", mp_random._CUDA_RNG_STATE_TRACKER)
    monkeypatch.setattr(mp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
                        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    monkeypatch.setattr(mp_random.CudaRNGStatesTracker, "add", lambda self, name, seed: added.append((name, seed)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: added.append(("torch.cuda.manual_seed", seed)))
    mp_random.model_parallel_cuda_manual_seed(7, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    assert added[0] == ("torch.cuda.manual_seed", 7)
    cuda_states = dict(added[1:])
    assert len(cuda_states) == 3

    cpu.model_parallel_manual_seed(7, tp_rank=1)
    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    assert isinstance(tracker, cpu._TRACKER_CLASS) and set(tracker.states_) == set(cuda_states)
    for name, seed in cuda_states.items():
        assert torch.equal(tracker.states_[name], torch.Generator().manual_seed(seed).get_state()), name
    assert torch.initial_seed() == 7


def _tiny_spec():
    from kdexp.config.qwen3 import Qwen3Spec

    return Qwen3Spec(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, tie_embeddings=False, max_position_embeddings=32)


def test_build_cuda_branch_inits_like_the_cpu_and_moves_the_model(monkeypatch):
    """On a GPU a random init is megatron's CPU master-weight init (the same weights as a CPU run with the same seed,
    for any TP size), then Module.cuda; without init (load_hf) the weights are allocated on the device (megatron
    code that runs on the CPU once cpu.apply() answers current_device). Only Module.cuda is recorded."""
    from kdexp import models
    from kdexp.models.build import transformer_config

    with lone_process(seed=5, monkeypatch=monkeypatch):  # CPU: cpu.apply() makes current_device() the CPU
        kd.reseed(11)
        on_cpu = dict(models.build(_tiny_spec()).named_parameters())
        moved = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: moved.append(device) or self)

        cfg = transformer_config(_tiny_spec())
        assert cfg.use_cpu_initialization is True and cfg.perform_initialization is True
        assert transformer_config(_tiny_spec(), init=False).use_cpu_initialization is False
        # the fusions that need Apex/TE kernels on a GPU stay off (the local spec has none of them)
        assert not (cfg.gradient_accumulation_fusion or cfg.masked_softmax_fusion or cfg.persist_layer_norm
                    or cfg.bias_activation_fusion or cfg.bias_dropout_fusion or cfg.apply_rope_fusion)
        # dropout off: no RNG is drawn on the device during a step, so the checkpoint's CPU RNG state is complete
        assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0

        kd.reseed(11)
        a = models.build(_tiny_spec())
        empty = models.build(_tiny_spec(), init=False)  # allocated on current_device(), left for load_hf
        assert moved == [torch.cuda.current_device()] * 2
        wa = dict(a.named_parameters())
        assert wa.keys() == on_cpu.keys() and all(torch.equal(wa[n], on_cpu[n]) for n in wa)  # = the CPU run
        qkv = wa["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert 0.01 < qkv.std().item() < 0.03  # init_method_std=0.02, not left empty
        assert all(getattr(p, "tensor_model_parallel", None) is not None
                   for n, p in empty.named_parameters() if n.endswith(("linear_qkv.weight", "linear_fc2.weight")))
        logits = models.vocab_parallel_logits(a, torch.randint(0, 96, (2, 8)))
        assert logits.shape == (2, 8, 96) and torch.isfinite(logits).all()


# --- the loss: the fused row kernels' non-CPU branch ------------------------------------------------------------------
def test_fused_row_kernels_off_the_cpu_return_a_new_tensor():
    """Off the CPU `softmax_`/`log_softmax_` are torch.softmax/log_softmax: a new tensor, the input untouched."""
    from kdexp.losses import _chunks

    x = torch.empty(4, 10, device="meta")
    for fn in (_chunks.softmax_, _chunks.log_softmax_):
        y = fn(x)
        assert y is not x and y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype


OPTIONS = [dict(), dict(divergence="reverse_kl"), dict(divergence="jsd", beta=0.3), dict(top_k=8),
           dict(top_k=8, temperature=2.0, divergence="reverse_kl"), dict(top_p=0.9, min_k=2),
           dict(top_k=8, normalization="renormalize", ghost_token=False), dict(top_k=8, divergence="jsd")]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "dense")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_through_the_non_cpu_kernels_matches_the_fused_cpu_path(monkeypatch, opts, dtype):
    """The loss with the non-CPU branch of the row kernels (new tensors; the input is then overwritten with NaN, so a
    caller that still read it, as the in-place CPU kernels allow, would turn the loss or the gradient NaN) equals
    the loss with the fused in-place CPU kernels, forward and backward."""
    from kdexp.losses import _autograd, _chunks, logits_kd_loss

    g = torch.Generator().manual_seed(0)
    s = (3 * torch.randn(6, 40, generator=g)).to(dtype)
    t = (3 * torch.randn(6, 40, generator=g)).to(dtype)

    def run():
        x = s.clone().requires_grad_(True)
        loss = logits_kd_loss(x, t, **opts)
        loss.sum().backward()
        return loss.detach(), x.grad

    ref_loss, ref_grad = run()
    fused = {"softmax_": torch.softmax, "log_softmax_": torch.log_softmax}
    for name, op in fused.items():
        def generic(x, op=op):
            assert x.device.type == "cpu"
            y = op(x, 1)  # the non-CPU branch's expression, on a CPU tensor
            x.fill_(float("nan"))
            return y
        for module in (_chunks, _autograd):  # the kernels' home and the Function that imported them
            monkeypatch.setattr(module, name, generic)
    loss, grad = run()
    assert torch.isfinite(loss).all() and torch.isfinite(grad.float()).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
