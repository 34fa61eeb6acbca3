"""kdexp.train.optim: the lr schedule against its hand formula, weight-decay groups, gradient clipping against a
hand-computed norm (also TP-sharded over two gloo processes) and data-parallel gradient averaging (two processes)."""
from __future__ import annotations

import math

import pytest
import torch

import kdexp.distributed as kd
from _lone_process import lone_process as _lone_process
from kdexp.distributed.testing import run_on_processes
from kdexp.train import optim



@pytest.fixture
def lone_process():
    with _lone_process(seed=1):
        yield


# ---------------------------------------------------------------------------------------------------------------------
# lr schedule: linear warmup over `warmup` steps (step 0 gets lr/warmup), then cosine from lr to min_lr at `total`

def test_lr_schedule_warmup_then_cosine_by_hand():
    kw = dict(lr=1.0, min_lr=0.1, warmup=4, total=14)
    # warmup: (step + 1) / 4
    assert [optim.lr_at(s, **kw) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-15)
    # cosine over the 10 steps after warmup: 0.1 + 0.45 * (1 + cos(pi * p)), p = (step - 4) / 10
    assert optim.lr_at(4, **kw) == pytest.approx(1.0, abs=1e-15)  # p = 0: the peak
    assert optim.lr_at(9, **kw) == pytest.approx(0.55, abs=1e-15)  # p = 0.5: halfway between lr and min_lr
    assert optim.lr_at(6, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.2 * math.pi)), abs=1e-15)
    assert optim.lr_at(6, **kw) == pytest.approx(0.1 + 0.45 * 1.8090169943749475, abs=1e-12)  # cos(pi/5) = 0.809...
    assert optim.lr_at(13, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.9 * math.pi)), abs=1e-15)
    assert optim.lr_at(14, **kw) == pytest.approx(0.1, abs=1e-15)  # min_lr at total ...
    assert optim.lr_at(40, **kw) == pytest.approx(0.1, abs=1e-15)  # ... and after it (never below)
    values = [optim.lr_at(s, **kw) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_lr_schedule_without_warmup_and_with_min_lr_equal_lr():
    assert optim.lr_at(0, lr=2.0, min_lr=0.0, warmup=0, total=4) == pytest.approx(2.0)
    assert optim.lr_at(2, lr=2.0, min_lr=0.0, warmup=0, total=4) == pytest.approx(1.0)
    assert [optim.lr_at(s, lr=0.3, min_lr=0.3, warmup=0, total=5) for s in range(6)] == pytest.approx([0.3] * 6)
    # warmup as long as the run: the whole run warms up
    assert [optim.lr_at(s, lr=1.0, min_lr=0.0, warmup=3, total=3) for s in range(3)] == pytest.approx(
        [1 / 3, 2 / 3, 1.0])


def test_set_lr_and_weight_decay_groups():
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(3, 4))
    model.add_module("final_norm", torch.nn.LayerNorm(4))
    frozen = torch.nn.Linear(4, 4)
    frozen.weight.requires_grad_(False)
    model.add_module("frozen", frozen)
    opt = optim.make_optimizer(model, lr=0.5, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(model.proj.weight)]  # matrices only; not the frozen one
    assert {id(p) for p in no_decay["params"]} == {id(model.proj.bias), id(model.final_norm.weight),
                                                   id(model.final_norm.bias), id(frozen.bias)}
    optim.set_lr(opt, 0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]


# ---------------------------------------------------------------------------------------------------------------------
# clipping

def _with_grads(*grads):
    model = torch.nn.Module()
    for i, g in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        model.register_parameter(f"p{i}", p)
    return model


def test_clip_gradients_scales_to_max_norm_and_returns_the_norm_before(lone_process):
    g1, g2 = torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0], [12.0, 0.0]])  # global norm sqrt(9+16+144) = 13
    model = _with_grads(g1, g2)
    norm = optim.clip_gradients(model, 1.0)
    assert norm.item() == pytest.approx(13.0, rel=1e-7)
    scale = 1.0 / (13.0 + 1e-6)
    torch.testing.assert_close(model.p0.grad, g1 * scale)
    torch.testing.assert_close(model.p1.grad, g2 * scale)
    after = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert after == pytest.approx(1.0, rel=1e-6)


def test_clip_gradients_leaves_small_gradients_and_zero_disables_it(lone_process):
    g = torch.tensor([0.3, 0.4])  # norm 0.5 < 1
    model = _with_grads(g)
    assert optim.clip_gradients(model, 1.0).item() == pytest.approx(0.5)
    torch.testing.assert_close(model.p0.grad, g)
    big = _with_grads(torch.tensor([30.0, 40.0]))
    assert optim.clip_gradients(big, 0.0).item() == pytest.approx(50.0)  # grad_clip=0: measured, not clipped
    torch.testing.assert_close(big.p0.grad, torch.tensor([30.0, 40.0]))


def test_average_gradients_is_a_no_op_on_one_rank(lone_process):
    model = _with_grads(torch.tensor([1.0, 2.0]))
    optim.average_gradients(model)
    torch.testing.assert_close(model.p0.grad, torch.tensor([1.0, 2.0]))


def _dp_worker(rank, world_size):
    """dp=2: each rank has its own gradients; after averaging both hold the mean. Returns them and the clip norm."""
    st = kd.initialize(tensor_parallel=1)
    assert (st.dp_size, st.dp_rank) == (2, rank)
    model = _with_grads(torch.tensor([1.0, 2.0]) * (rank + 1), torch.tensor([[rank * 4.0]]))
    optim.average_gradients(model)
    norm = optim.clip_gradients(model, 0.0)
    return [p.grad.clone() for p in model.parameters()], norm


def _tp_worker(rank, world_size):
    """tp=2: a sharded parameter (each rank its half) and a replicated one (the same on both ranks)."""
    st = kd.initialize(tensor_parallel=2)
    assert (st.tp_size, st.tp_rank, st.dp_size) == (2, rank, 1)
    shard = torch.tensor([3.0, 4.0]) if rank == 0 else torch.tensor([12.0, 0.0])
    model = _with_grads(shard, torch.tensor([0.0, 84.0]))  # replicated: counted once -> norm sqrt(169 + 84^2) = 85
    model.p0.tensor_model_parallel = True
    norm = optim.clip_gradients(model, 17.0)
    return norm, [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_data_parallel_averaging_over_two_gloo_processes():
    results = run_on_processes(_dp_worker, 2)
    mean = [torch.tensor([1.5, 3.0]), torch.tensor([[2.0]])]  # ([1,2] + [2,4]) / 2 and (0 + 4) / 2
    for grads, norm in results:
        for g, m in zip(grads, mean):
            torch.testing.assert_close(g, m, rtol=0, atol=0)
        assert norm.item() == pytest.approx(math.sqrt(1.5**2 + 3.0**2 + 2.0**2))  # the same on both ranks


@pytest.mark.slow
def test_tensor_parallel_clipping_counts_shards_once_each_and_replicas_once():
    (n0, g0), (n1, g1) = run_on_processes(_tp_worker, 2)
    assert n0.item() == pytest.approx(85.0) and n1.item() == pytest.approx(85.0)
    scale = 17.0 / (85.0 + 1e-6)  # 1/5
    torch.testing.assert_close(g0[0], torch.tensor([3.0, 4.0]) * scale)
    torch.testing.assert_close(g1[0], torch.tensor([12.0, 0.0]) * scale)
    torch.testing.assert_close(g0[1], torch.tensor([0.0, 84.0]) * scale)
    torch.testing.assert_close(g1[1], g0[1])  # replicas stay identical


# ---------------------------------------------------------------------------------------------------------------------
# the megatron path (kdexp.train.megatron_optim) against the torch path, as far as the CPU lets megatron run: its DDP
# runs here (grad buffers, no_sync, finish_grad_sync); its optimizers allocate on 'cuda' literally and do not

def _tiny_bf16_model(seed=7):
    from test_mixed import _spec

    from kdexp import models

    kd.reseed(seed)
    return models.build(_spec(), params_dtype=torch.bfloat16)


def _trainer(**kw):
    from types import SimpleNamespace

    base = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, grad_clip=1.0, distributed_optimizer=False)
    return SimpleNamespace(**{**base, **kw})


def _bf16_formats(distributed_optimizer=False):
    from kdexp.config import precision

    return precision.formats("float32", "bf16", "megatron", distributed_optimizer, cuda=True)


def test_megatron_path_is_taken_on_cuda_only(lone_process):
    from kdexp.train import megatron_optim

    assert not torch.cuda.is_available()  # this suite runs on CPU machines
    assert megatron_optim.uses_megatron("auto") is False and megatron_optim.uses_megatron("torch") is False
    with pytest.raises(ValueError, match="trainer.optimizer='megatron' is invalid here: .* need CUDA"):
        megatron_optim.uses_megatron("megatron")


def test_megatron_ddp_accumulates_the_same_fp32_grads_as_master_adamw(lone_process):
    """Two micro-batches (the first under no_sync): megatron's fp32 main_grad buffers hold exactly the fp32 master
    grads MasterAdamW accumulates from the same bf16 backward passes."""
    from megatron.core.distributed import DistributedDataParallel
    from test_mixed import _lm_backward, _tokens

    from kdexp.train import megatron_optim

    ours = _tiny_bf16_model()
    opt = optim.make_optimizer(ours, lr=1e-3, weight_decay=0.1, master_weights=True)
    theirs = _tiny_bf16_model()
    ddp = DistributedDataParallel(config=theirs.config, ddp_config=megatron_optim.ddp_config(_bf16_formats()),
                                  module=theirs)
    ddp.zero_grad_buffer()
    for i, seed in enumerate((0, 1)):
        _lm_backward(ours, _tokens(seed))
        with ddp.no_sync() if i == 0 else megatron_optim.contextlib.nullcontext():
            _lm_backward(ddp, _tokens(seed))
    ddp.finish_grad_sync()
    for (name, p), master in zip(theirs.named_parameters(), opt.master_params):
        assert p.main_grad.dtype == torch.float32 and master.grad.dtype == torch.float32
        assert torch.equal(p.main_grad, master.grad), name


def test_megatron_optimizer_config_is_the_torch_adamw_and_its_decay_groups(lone_process):
    from megatron.core import optimizer as mopt
    from megatron.core.distributed import DistributedDataParallel

    from kdexp.train import megatron_optim

    t = _trainer()
    cfg = megatron_optim.optimizer_config(t, _bf16_formats())
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps) == (*optim.BETAS, optim.EPS)
    assert (cfg.lr, cfg.min_lr, cfg.weight_decay, cfg.clip_grad) == (1e-3, 1e-4, 0.1, 1.0)
    assert cfg.bf16 and cfg.decoupled_weight_decay and cfg.main_params_dtype == torch.float32
    assert cfg.exp_avg_dtype == cfg.exp_avg_sq_dtype == cfg.main_grads_dtype == torch.float32
    # without TE/apex megatron's Adam is torch's AdamW, the class MasterAdamW steps with (GPUs get FusedAdam)
    assert mopt.Adam is torch.optim.AdamW and issubclass(optim.MasterAdamW, torch.optim.AdamW)
    model = _tiny_bf16_model()
    ddp = DistributedDataParallel(config=model.config, ddp_config=megatron_optim.ddp_config(_bf16_formats()),
                                  module=model)
    groups = mopt._get_param_groups([ddp], cfg, None)
    megatron_optim.apply_weight_decay(groups, t.weight_decay)  # what the CUDA path does to its optimizer's groups
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert decay_of[id(p)] == (0.1 if optim.decays(name, p) else 0.0), name


class _CpuDevice:
    """torch, with megatron clip_grads' literal device='cuda' read as the CPU (test only)."""

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name in ("zeros", "tensor"):
            return lambda *a, device=None, **k: fn(*a, **k)
        return fn


def test_megatron_grad_norm_and_clip_coefficient_match_ours(lone_process, monkeypatch):
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    for module in (clip_grads, mutils):  # get_grad_norm_fp32 and its local multi-tensor l2 norm
        monkeypatch.setattr(module, "torch", _CpuDevice())
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(5, 7, generator=g), torch.randn(11, generator=g), torch.randn(3, 2, 2, generator=g)]
    theirs = clip_grads.get_grad_norm_fp32([x.clone() for x in grads])
    model = _with_grads(*grads)
    ours = optim.clip_gradients(model, 0.5)
    assert float(ours) == pytest.approx(theirs, rel=1e-6)
    coeff = 0.5 / (theirs + 1.0e-6)  # clip_grad_by_total_norm_fp32's formula (it asserts CUDA tensors to run)
    for p, x in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, x * coeff, rtol=1e-6, atol=0)
