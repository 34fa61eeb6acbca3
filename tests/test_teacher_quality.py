"""kdexp.bench.teacher's statistics against hand computations, and the embedded teacher's pretraining recipe keys.

The quality thresholds of the real embedded default (val LM loss <= 4.0 nats, mean top-1 >= 0.30, median 0.95-nucleus
<= 512) are measured by ``python -m kdexp.bench.teacher`` (README, "How peaked is the teacher"): pretraining that
teacher takes minutes on 2 cores, more than this suite's budget allows, so they are not re-measured here. What is
tested: the statistics (a hand-computed distribution), the recipe reaching the trainer (each key changes the teacher
and its cache key) and the bench on a seconds-long teacher.
"""
from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module

from kdexp.bench import teacher as bench
from kdexp.train import teacher as teacher_mod


def test_token_stats_by_hand():
    # two tokens over a 5-token vocabulary; probabilities chosen so no cumulative sum sits on a cut (no ties)
    probs = torch.tensor([[0.70, 0.20, 0.06, 0.03, 0.01], [0.30, 0.28, 0.22, 0.17, 0.03]], dtype=torch.float64)
    perm = torch.tensor([[2, 0, 4, 1, 3], [1, 3, 0, 4, 2]])  # shuffled vocabulary order: the stats must sort
    logits = torch.empty_like(probs).scatter_(1, perm, probs.log()) + torch.tensor([[3.0], [-1.0]])  # shift-free
    labels = torch.stack([perm[0, 1], perm[1, 3]])  # the 0.20 token, then the 0.17 token
    s = bench.token_stats(logits.float(), labels, ks=(1, 2, 4, 16), p=0.95)
    assert s["nll"].tolist() == pytest.approx([-math.log(0.20), -math.log(0.17)], rel=1e-6)
    assert s["top1"].tolist() == pytest.approx([0.70, 0.30], rel=1e-6)
    # 0.95-nucleus: the mass before the 3rd token is 0.90 < 0.95, before the 4th 0.96 -> 3 tokens; in the second
    # row the mass before the 4th is 0.80, before the 5th 0.97 -> 4 tokens
    assert s["nucleus"].tolist() == [3.0, 4.0]
    assert s["kept@1"].tolist() == pytest.approx([0.70, 0.30], rel=1e-6)
    assert s["kept@2"].tolist() == pytest.approx([0.90, 0.58], rel=1e-6)
    assert s["kept@4"].tolist() == pytest.approx([0.99, 0.97], rel=1e-6)
    assert s["kept@16"].tolist() == pytest.approx([1.0, 1.0], rel=1e-6)  # K beyond the vocabulary keeps it all
    out = bench.summarize(s)
    assert out["tokens"] == 2 and out["nucleus_median"] == 3.0 and out["nucleus_mean"] == 3.5
    assert out["lm_loss"] == pytest.approx(-(math.log(0.20) + math.log(0.17)) / 2, rel=1e-6)


def test_uniform_teacher_is_as_flat_as_it_gets():
    s = bench.summarize(bench.token_stats(torch.zeros(3, 2048), torch.tensor([0, 5, 2047]), ks=(16, 1024)))
    assert s["lm_loss"] == pytest.approx(math.log(2048), rel=1e-9)
    assert s["top1_prob"] == pytest.approx(1 / 2048)
    assert s["nucleus_median"] == math.ceil(0.95 * 2048)  # 1946 tokens
    assert s["kept@16"] == pytest.approx(16 / 2048) and s["kept@1024"] == pytest.approx(0.5)


def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_every_recipe_key_reaches_the_recipe():
    base = teacher_mod.recipe(_cfg())
    changed = {
        "model.teacher_pretrain_steps=77": ("steps", 77),
        "model.teacher_pretrain_lr=0.004": ("lr", 0.004),
        "model.teacher_pretrain_min_lr=1e-5": ("min_lr", 1e-5),
        "model.teacher_pretrain_micro_batch_size=3": ("micro_batch_size", 3),
        "model.teacher_pretrain_weight_decay=0.3": ("weight_decay", 0.3),
        "trainer.grad_clip=0.5": ("grad_clip", 0.5),
    }
    for override, (key, value) in changed.items():
        r = teacher_mod.recipe(_cfg(override))
        same = set(base) - {key, "warmup_steps"}  # the warmup follows the steps
        assert r[key] == value and {k: r[k] for k in same} == {k: base[k] for k in same}, override
    # warmup: a fraction of the steps, at least one
    assert teacher_mod.recipe(_cfg("model.teacher_pretrain_steps=200",
                                   "model.teacher_pretrain_warmup_fraction=0.1"))["warmup_steps"] == 20
    assert teacher_mod.recipe(_cfg("model.teacher_pretrain_steps=5"))["warmup_steps"] == 1
