"""The teacher shipped with the package (kdexp/assets/teacher): intact, what the default config loads, reproducible
from its recipe, and refused when damaged. That it is peaked like a real LM on held-out code, measured from a cold
cache with nothing trained, is tests/test_readme.py's verbatim run of `python -m kdexp.bench.teacher`."""
from __future__ import annotations

import json
import shutil

import pytest
from hydra import compose, initialize_config_module

import kdexp.conf  # noqa: F401  (registers the schema and resolvers)
from kdexp import assets
from kdexp.bench.teacher import MAX_LM_LOSS, MAX_NUCLEUS, MIN_TOP1
from kdexp.config import validate
from kdexp.data import cache as data_cache



def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _recipe():
    return json.loads((assets.SHIPPED_TEACHER / "recipe.json").read_text())


def test_the_shipped_teacher_is_intact_and_complete():
    assert data_cache.verify(assets.SHIPPED_TEACHER) is None
    files = {p.name for p in assets.SHIPPED_TEACHER.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "recipe.json", data_cache.MANIFEST} <= files
    hf = json.loads((assets.SHIPPED_TEACHER / "config.json").read_text())
    assert hf["vocab_size"] == assets.shipped_vocab_size() == 2048
    from kdexp.models import get_spec

    spec = get_spec(assets.SHIPPED_SHAPE)  # the tiny-teacher shape, vocabulary from the tokenizer
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]) == \
        (spec.hidden_size, spec.num_layers, spec.num_heads)


def test_the_default_config_loads_it_and_pretrain_is_one_override_away():
    cfg = _cfg()
    validate(cfg)
    assert cfg.model.embedded_teacher == "shipped"
    assert assets.teacher_checkpoint(cfg.model) == str(assets.SHIPPED_TEACHER)
    assert assets.tokenizer_source(cfg) == ("model.embedded_teacher", str(assets.SHIPPED_TEACHER))
    pre = _cfg("model.embedded_teacher=pretrain")
    validate(pre)
    assert assets.teacher_checkpoint(pre.model) is None and assets.tokenizer_source(pre)[1] is None
    # a real checkpoint wins over both
    assert assets.teacher_checkpoint(_cfg("model.teacher_path=/ckpt/x").model) == "/ckpt/x"
    # the smoke preset keeps pretraining its seconds-long teacher on its own small corpus
    assert assets.teacher_checkpoint(_cfg("experiment=smoke").model) is None


def test_its_recipe_reproduces_the_recorded_settings():
    """recipe.json's overrides compose, validate and give exactly the recipe it records: the command that made the
    checkpoint (`python -m kdexp.bench.teacher --curve N --save DIR <overrides>`) is the one written there."""
    from kdexp.train.teacher import recipe

    rec = _recipe()
    cfg = _cfg(*rec["overrides"])
    validate(cfg)
    assert recipe(cfg) == rec["recipe"]
    # its sample length and its own seed (kdexp.bench.teacher --curve pretrains as get_teacher does)
    from kdexp.train.teacher import pretrain_seq_length

    assert pretrain_seq_length(cfg) == rec["seq_length"] and cfg.model.teacher_pretrain_seed == rec["seed"]
    assert rec["command"].startswith("python -m kdexp.bench.teacher --curve") and "--save" in rec["command"]
    # the measurement taken as saved (bfloat16 weights reloaded) meets the bar too
    got = rec["reloaded"]
    assert got["lm_loss"] <= MAX_LM_LOSS and got["top1_prob"] >= MIN_TOP1 and got["nucleus_median"] <= MAX_NUCLEUS


def test_a_damaged_shipped_teacher_is_an_error_not_a_silent_load(tmp_path, monkeypatch):
    from kdexp.train import teacher as teacher_mod

    copy = tmp_path / "teacher"
    shutil.copytree(assets.SHIPPED_TEACHER, copy)
    monkeypatch.setattr(assets, "SHIPPED_TEACHER", copy)
    teacher_mod.check_shipped()  # intact copy: fine
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"shipped teacher is damaged: .*model\.safetensors fails its checksum"
                                           r".*model\.embedded_teacher=pretrain"):
        teacher_mod.check_shipped()
    weights.write_bytes(bytes(data[:100]))
    with pytest.raises(RuntimeError, match="truncated"):
        teacher_mod.check_shipped()
