"""experiment=on_vs_off_policy composes into the ablation it promises: 5 arms x 5 seeds, every point a valid config
continuing one warm start (model.student_path, required) for the same steps, KD only, reverse KL over a Top-32 cut;
the arms differ only in where the tokens come from and in the cut's tail. experiment=on_policy_warm_start exports the
student the arms start from. (Running the ablation takes hours of CPU: not done here.)"""
from __future__ import annotations

import itertools
import json

import pytest
from omegaconf import OmegaConf

from kdexp import models
from kdexp.config import validate
from kdexp.config.qwen3 import spec_to_hf
from sweeps import REPO
from test_config import cfg_of

ARMS = {  # arm -> (rollout.name, on_policy_fraction, estimator, loss.name, ghost_token)
    "op_off": ("off", 0.0, "distribution", "topk", True),
    "op_ghost": ("on_policy", 1.0, "distribution", "topk", True),
    "op_renorm": ("on_policy", 1.0, "distribution", "renorm_topk", False),
    "op_sampled_token": ("on_policy", 1.0, "sampled_token", "topk", True),
    "op_mix": ("on_policy", 0.5, "distribution", "topk", True),
}


@pytest.fixture(autouse=True)
def _temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDEXP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_on_vs_off_policy_points(tmp_path):
    warm = tmp_path / "student_hf"  # what experiment=on_policy_warm_start exports: the tiny student's shape
    warm.mkdir()
    (warm / "config.json").write_text(json.dumps(spec_to_hf(models.get_spec("tiny-student", vocab_size=2048))))
    params = OmegaConf.load(REPO / "conf" / "experiment" / "on_vs_off_policy.yaml").hydra.sweeper.params
    arms, seeds = params["arm"].split(","), [int(s) for s in str(params["trainer.seed"]).split(",")]
    assert sorted(arms) == sorted(ARMS) and seeds == [1, 2, 3, 4, 5]
    configs = {}
    for arm, seed in itertools.product(arms, seeds):
        cfg = cfg_of("experiment=on_vs_off_policy", f"arm={arm}", f"trainer.seed={seed}", f"model.student_path={warm}")
        validate(cfg)
        r, loss = cfg.rollout, cfg.loss
        assert (r.name, r.on_policy_fraction, r.estimator, loss.name, loss.ghost_token) == ARMS[arm]
        assert (loss.top_k, loss.divergence, cfg.balancer.alpha, cfg.trainer.max_steps) == (32, "reverse_kl", 1.0, 200)
        assert cfg.experiment_arm == arm and cfg.trainer.seed == seed and cfg.model.student_path == str(warm)
        configs[arm] = OmegaConf.to_container(cfg, resolve=True)
    for c in configs.values():  # everything else is one config
        for key in ("rollout", "loss", "experiment_arm"):
            c.pop(key)
        c["trainer"].pop("seed")
    assert all(c == configs["op_off"] for c in configs.values())
    with pytest.raises(ValueError, match="model.student=None .* model.student_path is not set"):  # the warm start
        validate(cfg_of("experiment=on_vs_off_policy", "arm=op_ghost"))


def test_the_warm_start_exports_its_student():
    cfg = cfg_of("experiment=on_policy_warm_start")
    validate(cfg)
    assert cfg.trainer.export_hf is True and cfg.rollout.name == "off" and cfg.trainer.max_steps == 300
