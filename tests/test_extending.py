"""docs/extending.md's path for a new loss, followed as written: a per-token loss, a KD term (prepare / chunk), a
registry entry (kdexp.train.objective.register_loss) and loss.name selecting it; a smoke run trains with it on the
fused head and on the reference path, to the same numbers."""
from __future__ import annotations

import math

import pytest
import torch

from _lone_process import lone_process
from kdexp.train import objective


def logit_mse(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The new loss: per-token mean squared difference of the logits (TP=1: the whole vocabulary is local)."""
    return (student_logits.float() - teacher_logits.float()).pow(2).mean(-1)


class LogitMSETerm:
    fuses_lm = False  # the objective adds the LM cross-entropy itself
    calls = 0

    def __init__(self, loss_cfg, teacher_source):
        pass  # options would be parsed here, once

    def prepare(self, teacher, seed, device):
        return teacher  # the online teacher's output: chunk_logits(rows) forms its logits chunk by chunk

    def chunk(self, z, teacher, rows, labels):
        LogitMSETerm.calls += 1
        return objective.ChunkLoss(logit_mse(z, teacher.chunk_logits(rows)), None, {})


@pytest.mark.slow
def test_a_registered_loss_trains_a_smoke_run(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    import kdexp.config
    from kdexp.bench.gpu_scale import _random_teacher
    from kdexp.train.loop import distill

    monkeypatch.setattr(objective, "FAMILIES", dict(objective.FAMILIES))  # the registration ends with the test
    monkeypatch.setattr(objective, "LOSSES", dict(objective.LOSSES))
    objective.register_loss("logit_mse", LogitMSETerm, teachers=("online",))
    finals = {}
    for fused in (True, False):
        with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "experiment=smoke", "logger=none", "loss.name=logit_mse", f"loss.fused_head={str(fused).lower()}",
                "trainer.max_steps=3", "trainer.eval_interval=3", "trainer.checkpoint_interval=3"])
        kdexp.config.validate(cfg)
        LogitMSETerm.calls = 0
        (tmp_path / str(fused)).mkdir()
        with lone_process(seed=cfg.trainer.seed):
            finals[fused], _ = distill(cfg, tmp_path / str(fused), config_hash="mse", make_teacher=_random_teacher)
        assert LogitMSETerm.calls >= 3
    for final in finals.values():
        assert math.isfinite(final["train/kd_loss"]) and final["train/kd_loss"] > 0
        assert "train/kept_mass" not in final  # the term's own stats only
    for k in ("train/kd_loss", "train/lm_loss", "train/loss", "val/kl_to_teacher"):
        assert finals[True][k] == pytest.approx(finals[False][k], rel=1e-5), k
