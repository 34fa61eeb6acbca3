"""kdexp.train.objective: the registry picks one KD term per (loss, teacher); loss.fused_head (the output layer fused
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
from kdexp.train import objective


def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smoke", "logger=none", *overrides])
    kdexp.config.validate(cfg)
    return cfg


def test_the_registry_names_each_shipped_loss_and_refuses_an_unknown_one():
    assert objective.family(LossConfig()) == "logit"
    assert objective.family(LossConfig(name="dense", top_k=None)) == "logit"
    assert objective.family(LossConfig(name="sampled", top_k=None, ghost_token=False, samples=8)) == "sampled"
    assert {teacher for _, teacher in objective.LOSSES} == set(objective.TEACHERS)
    with pytest.raises(ValueError, match=r"loss.name='nope' is invalid: must be a registered loss, one of dense"):
        objective.family(LossConfig(name="nope"))


def _distill(tmp_path, name, overrides):
    """The final metrics of a 4-step smoke run in this process; a randomly initialised teacher unless the run reads
    a teacher cache (its key names the teacher's checkpoint: the smoke teacher, pretrained once per test session)."""
    from kdexp.bench.gpu_scale import _random_teacher
    from kdexp.train.loop import distill
    from kdexp.train.teacher import get_teacher

    cfg = _cfg("trainer.max_steps=4", "trainer.eval_interval=4", "trainer.checkpoint_interval=4", *overrides)
    (tmp_path / name).mkdir()
    with lone_process(seed=cfg.trainer.seed):
        final, _ = distill(cfg, tmp_path / name, config_hash=name,
                           make_teacher=get_teacher if "teacher=cached" in overrides else _random_teacher)
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
