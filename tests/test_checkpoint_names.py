"""Checkpoints name themselves: with model.teacher_path / student_path the size name is optional, the shape, parameter
count and label come from config.json, a name that disagrees with the checkpoint is refused in one line, and the
schema accepts exactly the spellings the model code reads (kdexp.config.qwen3.size_key, one table)."""
from __future__ import annotations

import json
import shutil

import pytest
from hydra import compose, initialize_config_module

from kdexp import assets, models
from kdexp.config import validate
from kdexp.config.qwen3 import QWEN3_SIZES, Qwen3Spec, spec_to_hf
from kdexp.plan import format_table, make_plan
from kdexp.plan.sizing import params_per_rank

CUSTOM_T = Qwen3Spec(vocab_size=2048, hidden_size=96, intermediate_size=192, num_layers=3, num_heads=6,
                     num_kv_heads=2, head_dim=16, tie_embeddings=True, max_position_embeddings=512)
CUSTOM_S = Qwen3Spec(vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, tie_embeddings=True, max_position_embeddings=512)


def _cfg(*overrides):
    with initialize_config_module(config_module="kdexp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _checkpoint(path, spec):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(spec_to_hf(spec)))
    shutil.copy(assets.SHIPPED_TEACHER / "tokenizer.json", path / "tokenizer.json")  # 2,048 ids
    return str(path)


def _spellings(key):
    return [key, key.upper(), f"Qwen3-{key.upper()}", f"qwen3-{key}", f"Qwen/Qwen3-{key.upper()}"]


def _model_code_accepts(name) -> bool:
    try:
        models.get_spec(name)
        return True
    except ValueError:
        return False


def _schema_accepts(name) -> bool:
    """Whether validate takes the name (a later check of another key, e.g. a real student's vocabulary beside the
    tiny teacher's, is not about the name)."""
    try:
        validate(_cfg(f"model.student={name}"))
        return True
    except ValueError as err:
        return not str(err).startswith(f"model.student={name!r} is invalid")


@pytest.mark.parametrize("name", [s for k in ("0.6b", "1.7b", "tiny-student") for s in _spellings(k)]
                         + ["1.7", "qwen2-1.7b", "Qwen/1.7b-instruct", "small"])
def test_the_schema_accepts_exactly_the_spellings_the_model_code_reads(name):
    assert _schema_accepts(name) == _model_code_accepts(name)
    if _model_code_accepts(name):
        assert models.get_spec(name) == QWEN3_SIZES[models.size_key(name)]


def test_custom_checkpoints_take_their_shape_and_label_from_config_json(tmp_path):
    from kdexp.train.point import model_labels

    t, s = _checkpoint(tmp_path / "tiny_t", CUSTOM_T), _checkpoint(tmp_path / "tiny_s", CUSTOM_S)
    cfg = _cfg("model.teacher=null", "model.student=null", f"model.teacher_path={t}", f"model.student_path={s}",
               "trainer.seq_length=64")
    validate(cfg)
    plan = make_plan(cfg)
    assert (plan.teacher, plan.student) == (f"tiny_t ({CUSTOM_T.num_params() / 1e6:,.1f}M)",
                                            f"tiny_s ({CUSTOM_S.num_params() / 1e6:,.1f}M)")
    assert format_table(plan).startswith(f"kdexp plan: teacher {plan.teacher} -> student {plan.student} on 1 GPU(s)")
    items = {k: b for k, b, _ in plan.items}
    assert items["teacher weights"] == 4 * params_per_rank(CUSTOM_T, 1) == 4 * CUSTOM_T.num_params()
    assert items["student weights"] == 4 * CUSTOM_S.num_params()
    labels = model_labels(cfg)  # what the run logs and records in summary.json
    assert labels["teacher"]["label"] == plan.teacher and labels["teacher"]["params"] == CUSTOM_T.num_params()
    assert labels["student"]["shape"].startswith(f"{CUSTOM_S.num_params() / 1e6:,.1f} M params: 2 layers x hidden 64")


def test_a_name_that_disagrees_with_the_checkpoint_is_refused(tmp_path):
    t = _checkpoint(tmp_path / "tiny_t", CUSTOM_T)
    with pytest.raises(ValueError) as err:
        validate(_cfg("model=qwen3", f"model.teacher_path={t}", "model.student=tiny-student"))
    line = str(err.value)
    assert "\n" not in line and line.startswith("model.teacher='1.7b' is invalid: ")
    assert f"model.teacher_path={t} is a checkpoint of another shape" in line and "hidden_size 96 vs 2048" in line
    assert "model.teacher=null" in line
    with pytest.raises(ValueError, match=r"^model.student=None is invalid: must name a size"):
        validate(_cfg("model.student=null"))  # no path: a name is needed


def test_a_name_that_matches_labels_the_checkpoint_by_its_size(tmp_path):
    s = _checkpoint(tmp_path / "qwen06", QWEN3_SIZES["0.6b"])
    for name in ("Qwen3-0.6B", "null"):
        cfg = _cfg(f"model.student={name}", f"model.student_path={s}", "model.vocab_alignment=tokenizer",
                   "trainer.seq_length=64")
        validate(cfg)
        assert make_plan(cfg).student == "0.6b"
