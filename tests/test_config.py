"""Config composition and value checks: wrong types/keys fail at compose time, bad values before anything is built."""
from __future__ import annotations

import json
import re

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import kdexp.conf  # noqa: F401  (registers the schema and resolvers)
from kdexp.config import config_hash, validate


def cfg_of(*overrides: str):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_composes_and_validates():
    cfg = cfg_of()
    validate(cfg)
    assert cfg.loss.name == "topk" and cfg.loss.ghost_token and cfg.balancer.alpha == 0.9
    assert cfg.model.teacher == "tiny-teacher" and cfg.data.name == "stdlib"


@pytest.mark.parametrize("group", ["loss=dense", "loss=topk", "loss=top_p", "loss=renorm_topk", "balancer=alpha",
                                   "balancer=dynamic", "logger=none", "arm=before", "arm=after", "arm=top_p",
                                   "experiment=smoke"])
def test_every_group_option_validates(group):
    validate(cfg_of(group))


def test_arms_select_their_loss_and_balancer():
    before = cfg_of("arm=before")
    assert (before.loss.normalization, before.loss.ghost_token, before.balancer.name) == ("renormalize", False,
                                                                                          "dynamic")
    assert before.balancer.skip_lm_loss is True and before.experiment_arm == "before"
    after = cfg_of("arm=after")
    assert (after.loss.normalization, after.loss.ghost_token, after.balancer.alpha) == ("full", True, 0.9)


def test_unknown_key_and_wrong_type_fail_at_compose():
    with pytest.raises(ConfigCompositionException, match="bogus"):
        cfg_of("loss.bogus=1")
    with pytest.raises(ConfigCompositionException, match="top_k"):
        cfg_of("loss.top_k=abc")
    with pytest.raises(ConfigCompositionException, match="alpha"):
        cfg_of("balancer.alpha=high")


@pytest.mark.parametrize("overrides, key, allowed", [
    (["loss=top_p", "loss.top_p=1.5"], "loss.top_p", r"\(0, 1\]"),
    (["loss=top_p", "loss.top_p=0"], "loss.top_p", r"\(0, 1\]"),
    (["balancer.alpha=-0.1"], "balancer.alpha", r"\[0, 1\]"),
    (["balancer.alpha=1.5"], "balancer.alpha", r"\[0, 1\]"),
    (["loss.top_k=8", "loss.min_k=16"], "loss.min_k", "loss.top_k=8"),
    (["loss.min_k=0"], "loss.min_k", ">= 1"),
    (["loss.top_k=0"], "loss.top_k", ">= 1"),
    (["loss.top_k=5000"], "loss.top_k", "vocabulary size 4096"),
    (["loss.temperature=0"], "loss.temperature", "> 0"),
    (["loss.divergence=hellinger"], "loss.divergence", "forward_kl"),
    (["loss.normalization=softmax"], "loss.normalization", "renormalize"),
    (["loss=renorm_topk", "loss.ghost_token=true"], "loss.ghost_token", "renormalize"),
    (["parallel.tensor=3"], "parallel.tensor", "heads"),
    (["parallel.tensor=0"], "parallel.tensor", ">= 1"),
    (["parallel.pipeline=2"], "parallel.pipeline", "must be 1"),
    (["trainer.max_steps=0"], "trainer.max_steps", ">= 1"),
    (["trainer.min_lr=1.0"], "trainer.min_lr", "trainer.lr"),
    (["model.params_dtype=float8"], "model.params_dtype", "bfloat16"),
    (["model.teacher=giant"], "model.teacher", "tiny-teacher"),
    (["model.teacher=8b"], "model.teacher_path", "required"),
    (["model.teacher_path=/nonexistent/ckpt"], "model.teacher_path", "config.json"),
    (["data=indexed", "data.prefixes=[]"], "data.prefixes", "at least one"),
    (["data.val_fraction=0.9"], "data.val_fraction", r"\(0, 0.5\)"),
])
def test_bad_values_name_the_key(overrides, key, allowed):
    with pytest.raises(ValueError) as err:
        validate(cfg_of(*overrides))
    message = str(err.value)
    assert message.startswith(key), message
    assert re.search(allowed, message), message


def test_tensor_parallel_must_divide_the_vocabulary():
    # 4 heads / 2 kv heads (teacher), 2 heads / 1 kv head (student): TP=2 only fails on an odd vocabulary
    with pytest.raises(ValueError, match=r"parallel.tensor.*(vocabulary|heads)"):
        validate(cfg_of("parallel.tensor=2", "data.vocab_size=4095"))


def test_removed_modelopt_keys_point_to_alpha():
    with pytest.raises(ValueError, match=r"balancer.skip_lm_loss.*use balancer.alpha.*alpha=1.0"):
        validate(cfg_of("balancer.skip_lm_loss=true"))
    with pytest.raises(ValueError, match=r"balancer.kd_loss_scale.*use balancer.alpha"):
        validate(cfg_of("balancer.kd_loss_scale=2.0"))


def _hf_dir(tmp_path, name, vocab, heads=4, kv=2):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": vocab, "num_attention_heads": heads,
                                               "num_key_value_heads": kv}))
    return d


def test_teacher_student_vocabulary_mismatch(tmp_path):
    t = _hf_dir(tmp_path, "t", 4096)
    s = _hf_dir(tmp_path, "s", 4000)
    with pytest.raises(ValueError, match=r"teacher vocabulary \(4096\).*student vocabulary \(4000\)"):
        validate(cfg_of(f"model.teacher_path={t}", f"model.student_path={s}"))


def test_config_hash_ignores_logging_and_paths_only():
    base = config_hash(cfg_of())
    assert config_hash(cfg_of("logger=none")) == base
    assert config_hash(cfg_of("paths.cache=/elsewhere")) == base
    assert config_hash(cfg_of("balancer.alpha=0.5")) != base
    assert config_hash(cfg_of("loss=top_p")) != base
    assert OmegaConf.select(cfg_of(), "paths.index").endswith("points")
