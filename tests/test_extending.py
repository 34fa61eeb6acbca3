"""docs/extending.md's path for a new loss, followed as written: the page's Python block (a per-token loss, its KD term
with prepare / chunk, the register_loss call) runs as printed, its YAML block becomes conf/loss/logit_mse.yaml on a
config search path, and a smoke run with `loss=logit_mse` trains with it on the fused head and on the reference
path, to the same numbers."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _lone_process import lone_process
from kdexp import objective
from kdexp.losses.options import LOSS_NAMES
from test_readme import parse

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _block(lang: str) -> str:
    """The page's one block in `lang` that names this module as its test."""
    found = [b.body for b in parse(PAGE.read_text(), PAGE)
             if b.lang == lang and b.kind == "covered" and "tests/test_extending.py::" in b.arg]
    assert len(found) == 1, (lang, len(found))
    return found[0]


@pytest.fixture
def registered():
    """The page's Python block run as printed (its register_loss call included); the registry is restored when the
    test ends."""
    saved = dict(LOSS_NAMES), dict(objective.LOSSES)
    ns: dict = {"__name__": "extending_doc"}
    exec(compile(_block("python"), str(PAGE), "exec"), ns)
    assert LOSS_NAMES["logit_mse"].family == "logit_mse"
    assert objective.LOSSES[("logit_mse", "online")] is ns["LogitMSETerm"]
    yield ns
    for table, before in zip((LOSS_NAMES, objective.LOSSES), saved):
        table.clear()
        table.update(before)


def test_the_documented_term_matches_its_formula(registered):
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(6, 11, generator=g), torch.randn(6, 11, generator=g)
    term = registered["LogitMSETerm"](None, None)
    side = term.prepare(SimpleNamespace(chunk_logits=lambda rows: t[rows]), seed=0, device="cpu")
    out = term.chunk(z[2:5], side, slice(2, 5), None)
    want = [sum((float(z[i, j]) - float(t[i, j])) ** 2 for j in range(11)) / 11 for i in range(2, 5)]
    torch.testing.assert_close(out.kd.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    assert out.lm is None and out.stats is None and term.fuses_lm is False


def test_the_config_checks_accept_a_name_only_once_it_is_registered(registered, monkeypatch, tmp_path):
    """register_loss adds the name to the one table of loss names (kdexp.losses.options.LOSS_NAMES) that validate()
    reads: refused before, accepted after."""
    from hydra import compose, initialize_config_module

    import kdexp.config

    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path))
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smoke", "logger=none", "loss.name=logit_mse"])
    kdexp.config.validate(cfg)
    del LOSS_NAMES["logit_mse"]
    with pytest.raises(ValueError, match=r"^loss\.name='logit_mse' is invalid: must be one of "):
        kdexp.config.validate(cfg)


@pytest.mark.slow
def test_a_registered_loss_trains_a_smoke_run(registered, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    import kdexp.config
    from kdexp.bench.gpu_scale import random_teacher
    from kdexp.train.loop import distill

    conf = tmp_path / "conf"
    (conf / "loss").mkdir(parents=True)
    (conf / "loss" / "logit_mse.yaml").write_text(_block("yaml"))
    term = registered["LogitMSETerm"]
    calls = []
    chunk = term.chunk
    monkeypatch.setattr(term, "chunk", lambda self, *a: calls.append(1) or chunk(self, *a))
    finals = {}
    for fused in (True, False):
        with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                f"hydra.searchpath=[file://{conf}]", "experiment=smoke", "logger=none", "loss=logit_mse",
                f"loss.fused_head={str(fused).lower()}", "trainer.max_steps=3", "trainer.eval_interval=3",
                "trainer.checkpoint_interval=3"])
        assert cfg.loss.name == "logit_mse"
        kdexp.config.validate(cfg)
        calls.clear()
        (tmp_path / str(fused)).mkdir()
        with lone_process(seed=cfg.trainer.seed):
            finals[fused], _ = distill(cfg, tmp_path / str(fused), config_hash="mse", make_teacher=random_teacher)
        assert len(calls) >= 3
    for final in finals.values():
        assert math.isfinite(final["train/kd_loss"]) and final["train/kd_loss"] > 0
        assert "train/kept_mass" not in final  # the term's own stats only
    for k in ("train/kd_loss", "train/lm_loss", "train/loss", "val/kl_to_teacher"):
        assert finals[True][k] == pytest.approx(finals[False][k], rel=1e-5), k
