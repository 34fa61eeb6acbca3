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
