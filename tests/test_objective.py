"""kdexp.objective: the registry picks one KD term per (loss, teacher); loss.fused_head (the output layer fused
into the objective, kdexp.losses.head) gives the reference path's training and eval numbers: a smoke run fused vs
unfused for online Top-K, dense, sampled and cached teachers (final metrics within 1e-5 relative), and the eval
metrics of one batch against the whole-logits ones; a student's sequence-sharded hidden states are refused nowhere
(the objective gathers them; TP=2 SP runs are models/'s tests)."""
from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module

import kdexp.config
from _lone_process import lone_process
from kdexp.config import LossConfig
from kdexp import objective


def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smoke", "logger=none", *overrides])
    kdexp.config.validate(cfg)
    return cfg


def test_the_registry_names_each_shipped_loss_and_refuses_an_unknown_one():
    def family(**kw):
        return objective.family(objective.LossOptions.parse(LossConfig(**kw)))

    assert family() == "logit"
    assert family(name="dense", top_k=None) == "logit"
    assert family(name="sampled", top_k=None, ghost_token=False, samples=8) == "sampled"
    assert {teacher for _, teacher in objective.LOSSES} == set(objective.TEACHERS)
    with pytest.raises(ValueError, match=r"loss.name='nope' is invalid: must be a registered loss, one of sampled, "
                                         r"top_p, renorm_topk, topk, dense"):
        family(name="nope")


def _distill(tmp_path, name, overrides):
    """The final metrics of a 4-step smoke run in this process; a randomly initialised teacher unless the run reads
    a teacher cache (its key names the teacher's checkpoint: the smoke teacher, pretrained once per test session)."""
    from kdexp.bench.gpu_scale import random_teacher
    from kdexp.train.loop import distill
    from kdexp.train.teacher import get_teacher

    cfg = _cfg("trainer.max_steps=4", "trainer.eval_interval=4", "trainer.checkpoint_interval=4", *overrides)
    (tmp_path / name).mkdir()
    with lone_process(seed=cfg.trainer.seed):
        final, _ = distill(cfg, tmp_path / name, config_hash=name,
                           make_teacher=get_teacher if "teacher=cached" in overrides else random_teacher)
    return final


RUNS = {"online top-k": (), "dense, alpha 0.5": ("loss=dense", "balancer.alpha=0.5"),
        "online sampled": ("loss=sampled",), "cached top-k": ("teacher=cached", "teacher.shard_samples=4"),
        "cached sampled, dynamic": ("loss=sampled", "teacher=cached", "teacher.shard_samples=4", "balancer=dynamic")}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", RUNS.values(), ids=RUNS.keys())
def test_a_smoke_run_fused_and_unfused_ends_with_the_same_metrics(tmp_path, overrides):
    fused = _distill(tmp_path, "fused", ("loss.fused_head=true", *overrides))
    unfused = _distill(tmp_path, "unfused", ("loss.fused_head=false", *overrides))
    keys = [k for k in unfused if not k.startswith("perf/")]
    assert {"train/kd_loss", "train/lm_loss", "val/kl_to_teacher", "val/top1_agreement", "val/lm_loss"} <= set(keys)
    assert set(fused) == set(unfused)
    for k in keys:
        assert math.isfinite(unfused[k]), k
        assert fused[k] == pytest.approx(unfused[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_eval_metrics_fused_equal_the_whole_logits(tied):
    """val/kl_to_teacher, val/top1_agreement, val/lm_loss of one batch: chunked from the final hidden states and the
    output weight (tied embedding or output layer) as from the models' whole logits, and the hidden states + weight
    give the model's own logits."""
    import dataclasses

    from kdexp import models

    with lone_process(seed=0):
        spec = dataclasses.replace(models.get_spec("tiny-student", vocab_size=96), tie_embeddings=tied)
        student, teacher = models.build(spec), models.build(dataclasses.replace(spec, tie_embeddings=True))
        teacher.requires_grad_(False)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 96, (2, 12), generator=g)
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
                 "loss_mask": (torch.rand(2, 12, generator=g) > 0.2).float()}
        hidden, weight = models.final_hidden(student, tokens)
        assert (weight is student.embedding.word_embeddings.weight) == tied
        torch.testing.assert_close((hidden @ weight.T).transpose(0, 1), models.vocab_parallel_logits(student, tokens),
                                   rtol=1e-5, atol=1e-5)
        denom = batch["loss_mask"].sum()
        got = {}
        for fused in (True, False):
            obj = objective.Objective(LossConfig(), None, None, fused=fused, fuses_lm=False,
                                      eval_teacher=objective.OnlineTeacher(teacher, fused=fused))
            got[fused] = obj.evaluate(student, batch, denom)
    torch.testing.assert_close(got[True], got[False], rtol=1e-5, atol=1e-6)
    assert 0 <= float(got[False][1]) <= 1 and float(got[False][0]) > 0


def _grads_of_one_step(fused: bool, coefficients, sequence_parallel: bool = False, tied: bool = True) -> dict:
    """Loss and every student gradient (gathered over TP, HF names) of one balanced KD + LM step (Top-K 32 + ghost,
    fused LM, online teacher) through the objective, after the step's TP rule for norm weights."""
    import dataclasses

    from megatron.core import parallel_state as ps

    import kdexp.distributed as kd
    from kdexp import models
    from kdexp.losses import KDLossOptions
    from kdexp.models.hf import gather_tp, hf_tensors

    kd.reseed(7)
    spec = dataclasses.replace(models.get_spec("tiny-student", vocab_size=256, max_position_embeddings=64),
                               tie_embeddings=tied)
    student = models.build(spec, sequence_parallel=sequence_parallel)
    teacher = models.build(dataclasses.replace(spec, tie_embeddings=True), sequence_parallel=sequence_parallel)
    teacher.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (2, 32), generator=g)
    labels = torch.roll(tokens, -1, 1)
    labels[0, -3:] = -100  # ignored ids
    batch = {"tokens": tokens, "labels": labels, "loss_mask": (torch.rand(2, 32, generator=g) > 0.2).float()}
    loss_cfg = LossConfig(top_k=32)
    term = objective.LogitTerm(KDLossOptions.from_config(loss_cfg))
    obj = objective.Objective(loss_cfg, objective.OnlineTeacher(teacher, fused=fused), term, fused=fused,
                              fuses_lm=term.fuses_lm, coefficients=coefficients)
    r = obj(obj.student(student, batch), obj.teacher(batch), batch, batch["loss_mask"].sum())
    loss = 0.7 * r.kd + 0.3 * r.lm
    loss.backward()
    kd.sum_grads_over_tp(student.parameters())
    st, grads = kd.state(), {}
    for name, p in student.named_parameters():
        grads.update(hf_tensors(name, gather_tp(p, ps.get_tensor_model_parallel_group(), st.tp_size, p.grad), spec,
                                 st.tp_size))
    return {"loss": loss.detach(), "grads": grads}


CASES = {"unfused": (False, None), "fused, recompute": (True, None), "fused, coefficients": (True, (0.7, 0.3))}


def _tp2_worker(rank, world_size):
    import kdexp.distributed as kd

    kd.initialize(tensor_parallel=2, seed=5)
    out = {(name, sp, tied): _grads_of_one_step(*CASES[name], sequence_parallel=sp, tied=tied)
           for name in CASES for sp in (False, True) for tied in (True, False)}
    return out if rank == 0 else None


@pytest.mark.slow
def test_tp2_fused_head_gives_tp1s_loss_and_every_gradient():
    """The fused head at TP 2 (vocabulary-sharded output weight, tied embedding or not, with and without sequence
    parallelism, both backward modes) against the whole-logits path at TP 1: the loss and every student gradient
    (embedding / output weight, every layer, the norms) within 1e-5 relative. The hidden states' gradient is the sum
    of the ranks' partial dz @ W_shard: a region that drops it (megatron's copy region on the non-contiguous gradient
    of the [s, b, h] -> [b*s, h] reshape did) leaves every gradient ~70% off."""
    from kdexp.distributed.testing import run_on_processes

    with lone_process(seed=5):
        ref = {tied: _grads_of_one_step(False, None, tied=tied) for tied in (True, False)}
    res = run_on_processes(_tp2_worker, 2)[0]
    for (name, sp, tied), r in res.items():
        one = ref[tied]
        assert (r["loss"] - one["loss"]).abs() <= 1e-5 * one["loss"].abs(), (name, sp, tied)
        assert r["grads"].keys() == one["grads"].keys()
        for k, want in one["grads"].items():
            rel = float((r["grads"][k] - want).norm() / want.norm().clamp_min(1e-12))
            assert rel <= 1e-5, (name, sp, tied, k, rel)


def test_the_fused_head_is_accepted_under_tensor_and_sequence_parallelism():
    for overrides in (("parallel.tensor=2",), ("parallel.tensor=2", "parallel.sequence=true")):
        assert _cfg("loss.fused_head=true", *overrides).loss.fused_head is True  # validated, not refused
