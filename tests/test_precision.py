"""kdexp.config.precision: the one rule for weights, gradient and optimizer-state formats, asked by the trainer and the
plan. For every combination of model.params_dtype, trainer.precision, trainer.optimizer and
trainer.distributed_optimizer the plan's student weight, gradient and optimizer bytes are compared with what the
trainer builds: on the torch path the tensors it holds after a real step; on the megatron path (whose optimizers need
CUDA) megatron's DDP gradient buffers built on the CPU and the OptimizerConfig the trainer hands megatron, whose main
params and Adam-state dtypes megatron allocates by."""
from __future__ import annotations

import itertools

import pytest
import torch
from hydra import compose, initialize_config_module

from _lone_process import lone_process
from kdexp.config import precision
from kdexp.plan import make_plan
from kdexp.objective import lm_loss
from kdexp.train import loop, megatron_optim, optim
from kdexp.train.step import optimizer_tensors
from kdexp import models

COMBOS = list(itertools.product(("float32", "bfloat16"), ("fp32", "bf16")))


def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=smoke", *overrides])


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _planned(cfg, gpus=1) -> dict:
    items = {name: b for name, b, _ in make_plan(cfg, gpus=gpus).items}
    return {k: items[k] for k in ("student weights", "student gradients", "optimizer state")}


def _step(student, opt, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = models.vocab_parallel_logits(student, tokens[:, :-1])
    lm_loss(logits, tokens[:, 1:], torch.ones(2, 16)).backward()


def test_the_rule_by_hand():
    fp32 = precision.formats("float32", "fp32", "torch", cuda=False)
    assert (fp32.weight_bytes, fp32.grad_bytes, fp32.optimizer_bytes, fp32.master) == (4, 4, 8, None)
    for params_dtype, prec in (("bfloat16", "fp32"), ("float32", "bf16"), ("bfloat16", "bf16")):
        f = precision.formats(params_dtype, prec, "auto", True, cuda=True)
        assert (f.weight_bytes, f.grad_bytes, f.optimizer_bytes, f.master, f.megatron, f.sharded) == \
            (2, 4, 12, "float32", True, True)
    assert not precision.formats("float32", "fp32", "auto", True, cuda=False).sharded  # the torch path shards nothing
    with pytest.raises(ValueError, match="trainer.precision='fp16' is invalid"):
        precision.formats("float32", "fp16", cuda=True)


@pytest.mark.parametrize("params_dtype,prec", COMBOS)
def test_plan_bytes_are_the_torch_trainers_state(params_dtype, prec):
    """optimizer=torch (and auto, which is torch on the CPU): the student, its gradients as the optimizer reads them
    (the fp32 masters' under bf16 weights) and the optimizer's state after one real step, byte for byte."""
    for optimizer in ("torch", "auto"):
        cfg = _cfg(f"model.params_dtype={params_dtype}", f"trainer.precision={prec}", f"trainer.optimizer={optimizer}")
        with lone_process(seed=5):
            student = loop.build_student(cfg, cfg.data.vocab_size)
            opt = loop.build_optimizer(cfg, student)
            _step(student, opt, cfg.data.vocab_size)
            # every gradient held after the backward: the optimizer's (the masters' under bf16 weights) and any the
            # model itself still holds
            grads = {id(g): g for p in [*optim.grad_params(student, opt), *student.parameters()]
                     for g in [p.grad] if g is not None}
            opt.step()
            n = sum(p.numel() for p in student.parameters())
            # Adam's per-tensor step counters are scalars, not per-parameter state
            state = [t for t in optimizer_tensors(opt) if t.numel() > 1]
            held = {"student weights": _bytes(student.parameters()),
                    "student gradients": _bytes(grads.values()),
                    "optimizer state": _bytes(state)}
        assert held == _planned(cfg), (optimizer, params_dtype, prec)
        bf16 = "bfloat16" in (params_dtype, "bfloat16" if prec == "bf16" else "")
        assert held["optimizer state"] == (12 if bf16 else 8) * n  # the masters too, under bf16 weights


@pytest.mark.parametrize("params_dtype,prec,distributed", [(*c, d) for c in COMBOS for d in (False, True)])
def test_plan_bytes_are_megatrons_buffers_and_config(params_dtype, prec, distributed):
    """optimizer=megatron (and auto on CUDA): the student in the rule's dtype, megatron's DDP built on the CPU with the
    trainer's ddp_config (its main_grad buffers are the gradients), and the OptimizerConfig the trainer gives
    get_megatron_optimizer: fp32 weights are their own main params (FP32Optimizer), bf16 ones get fp32 main params;
    Adam's moments in exp_avg(_sq)_dtype; the distributed optimizer splits both over DP (2 GPUs = DP 2 here)."""
    from megatron.core.distributed import DistributedDataParallel

    cfg = _cfg(f"model.params_dtype={params_dtype}", f"trainer.precision={prec}", "trainer.optimizer=megatron",
               f"trainer.distributed_optimizer={str(distributed).lower()}")
    formats = precision.of(cfg, cuda=True)
    with lone_process(seed=5):
        student = loop.build_student(cfg, cfg.data.vocab_size)
        ddp = DistributedDataParallel(config=student.config, ddp_config=megatron_optim.ddp_config(formats),
                                      module=student)
        ocfg = megatron_optim.optimizer_config(cfg.trainer, formats)
        assert student.config.params_dtype == models.DTYPES[formats.weights]
        n = sum(p.numel() for p in student.parameters())
        grads = _bytes(p.main_grad for p in student.parameters())
        del ddp
    weights = _bytes(student.parameters())
    master = 4 if ocfg.bf16 else 0
    assert ocfg.bf16 == (weights == 2 * n) and ocfg.main_params_dtype == torch.float32
    moments = (torch.tensor([], dtype=ocfg.exp_avg_dtype).element_size()
               + torch.tensor([], dtype=ocfg.exp_avg_sq_dtype).element_size())
    share = 2 if ocfg.use_distributed_optimizer else 1
    assert ocfg.use_distributed_optimizer == distributed
    assert _planned(cfg, gpus=2) == {"student weights": weights, "student gradients": grads,
                                     "optimizer state": (master + moments) * n / share}


def test_the_default_qwen3_preset_plans_its_fp32_optimizer_state():
    """model=qwen3 sets model.params_dtype=bfloat16 with trainer.precision=fp32: the trainer keeps fp32 masters,
    gradients and Adam state as with trainer.precision=bf16, and the plan now says the same for both."""
    over = ("model=qwen3", "model.teacher=8b", "model.student=4b", "trainer.seq_length=2048",
            "trainer.micro_batch_size=1")
    default, bf16 = make_plan(_cfg(*over)), make_plan(_cfg(*over, "trainer.precision=bf16"))
    assert default.items == bf16.items and default.precision == bf16.precision
    n = dict((k, b) for k, b, _ in default.items)["student weights"] / 2
    assert dict((k, b) for k, b, _ in default.items)["optimizer state"] == 12 * n
