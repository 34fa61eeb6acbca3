"""experiment=ghost_vs_renorm composes into the ablation it promises: 9 arms x 5 seeds, every point a valid config
from the offline teacher cache, KD only, Top-K cuts that drop real mass renormalised or with a ghost token, and Top-P at
the mass each cut keeps. (Running it takes hours of CPU: not done here.)"""
from __future__ import annotations

import itertools

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from kdexp.config import validate
from kdexp.report.params import ARM_KEYS  # noqa: F401  (the report reads experiment_arm: the arms table)
from sweeps import REPO

# The shipped teacher's mean kept mass of its Top-K on the validation split (kdexp.bench.teacher's kept@K over 64
# sequences, 16,384 tokens): what each topp_kK arm's loss.top_p is set to.
KEPT = {8: 0.7364, 32: 0.8583, 128: 0.9454}


def cfg_of(*overrides: str):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_ghost_vs_renorm_points():
    params = OmegaConf.load(REPO / "conf" / "experiment" / "ghost_vs_renorm.yaml").hydra.sweeper.params
    arms, seeds = params["arm"].split(","), [int(s) for s in str(params["trainer.seed"]).split(",")]
    assert len(arms) == 9 and seeds == [1, 2, 3, 4, 5]
    for arm, seed in itertools.product(arms, seeds):
        cfg = cfg_of("experiment=ghost_vs_renorm", f"arm={arm}", f"trainer.seed={seed}")
        validate(cfg)
        loss = cfg.loss
        assert cfg.experiment_arm == arm and cfg.trainer.seed == seed
        assert cfg.teacher.name == "cached" and cfg.balancer.name == "alpha" and cfg.balancer.alpha == 1.0
        assert cfg.trainer.max_steps == 1000 and loss.top_k is None or loss.top_k <= cfg.teacher.k_max
        k = int(arm.split("k")[-1].split("_")[0])
        if arm.endswith("_renorm"):
            assert (loss.top_k, loss.top_p, loss.normalization, loss.ghost_token) == (k, None, "renormalize", False)
        elif arm.endswith("_ghost"):
            assert (loss.top_k, loss.top_p, loss.normalization, loss.ghost_token) == (k, None, "full", True)
        else:  # a nucleus holding the mass Top-K keeps, ghost token for the rest
            assert arm == f"topp_k{k}"
            assert (loss.top_k, loss.normalization, loss.ghost_token) == (1024, "full", True)  # the cache holds 1024
            assert loss.top_p == pytest.approx(KEPT[k], abs=5e-4)
    # the arms differ only in the loss: everything else is the same config
    base = OmegaConf.to_container(cfg_of("experiment=ghost_vs_renorm", "arm=k8_renorm"), resolve=True)
    other = OmegaConf.to_container(cfg_of("experiment=ghost_vs_renorm", "arm=topp_k128"), resolve=True)
    for c in (base, other):
        c.pop("loss"), c.pop("experiment_arm")
    assert base == other
